"""`model.chat_template`: a template file that replaces the model's own, read at start; a file
that cannot be read stops the start as a configuration error (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stratad.config import Config, ModelConfig
from tests.server_helpers import tiny_moe_path

REPO = Path(__file__).resolve().parents[1]
OVERRIDE = (
    "{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }} [[end]]\n{% endfor %}"
    "{% if add_generation_prompt %}[[assistant]] {% endif %}"
)


def test_the_override_replaces_the_models_template(tmp_path: Path) -> None:
    from stratad.model.text.tokenizer_build import load_tokenizer
    from stratad.store.loader import load_model

    template = tmp_path / "override.jinja"
    template.write_text(OVERRIDE)
    config = Config(model=ModelConfig(path=str(tiny_moe_path()), chat_template=str(template)))
    model = load_model(Path(config.model.path))
    own = load_tokenizer(model)
    # what the engine loads (stratad.runtime.service.Engine), without the engine's start
    tokenizer = load_tokenizer(model, config.model.chat_template_text())
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == "[[user]] Hi there [[end]]\n[[assistant]] "
    assert own.apply_chat_template(messages) != prompt
    # what a chat request is tokenized as
    assert tokenizer.encode_chat(messages) == tokenizer.encode(prompt, False)


def test_an_unreadable_template_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jinja"
    config = tmp_path / "stratad.toml"
    config.write_text(f'[model]\nchat_template = "{missing}"\n[control]\nsocket = ""\n')
    proc = subprocess.run(
        [sys.executable, "-m", "stratad", "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.chat_template" in lines[0] and str(missing) in lines[0]
    assert "No such file" in lines[0]
