"""The engine as the daemon runs it: model, tokenizer and generator behind `Job`s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from stratad.config import Config
from stratad.engine.forward import ReferenceForward
from stratad.engine.generate import GenerationRequest, Generator
from stratad.engine.sampling import SamplingParams
from stratad.jobs import Delta, Job, JobError
from stratad.model.default import default_model_path
from stratad.model.loader import load_model
from stratad.model.spec import Model
from stratad.model.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf

log = logging.getLogger("stratad.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    arch: str
    max_context: int
    device: str


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"engine.device={name!r} but no GPU is visible to torch")
    return device


def load_tokenizer(model: Model) -> Tokenizer:
    if model.source.is_dir():
        return tokenizer_from_hf(model.source)
    return tokenizer_from_gguf(model.metadata)


class Engine:
    """Runs one job at a time (the caller serialises); not thread-safe by design."""

    def __init__(self, config: Config) -> None:
        path = Path(config.model.path) if config.model.path else default_model_path()
        device = pick_device(config.engine.device)
        dtype = (
            (torch.float32 if device.type == "cpu" else torch.bfloat16)
            if config.engine.dtype == "auto"
            else _DTYPES[config.engine.dtype]
        )
        if config.engine.threads:
            torch.set_num_threads(config.engine.threads)
        t0 = time.monotonic()
        self.model = load_model(path)
        self.tokenizer = load_tokenizer(self.model)
        self.forward = ReferenceForward(self.model, device, dtype)
        max_context = min(config.model.max_context, self.model.spec.context_length)
        self.generator = Generator(self.forward, self.tokenizer, max_context)
        self.info = EngineInfo(
            model_id=config.model.name or path.name,
            arch=self.model.spec.arch,
            max_context=max_context,
            device=str(device),
        )
        log.info(
            "model %s loaded: arch %s, %d layers, %s on %s, context %d (%.1f s)",
            path, self.model.spec.arch, self.model.spec.n_layers, dtype, device, max_context,
            time.monotonic() - t0,
        )

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def max_context(self) -> int:
        return self.info.max_context

    def tokenize(self, job: Job) -> list[int]:
        if job.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in job.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special=False)
        return self.tokenizer.encode(job.prompt or "", add_special=True)

    def run(self, job: Job, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Delta]:
        prompt = self.tokenize(job)
        if not prompt:
            raise JobError("the prompt is empty")
        if len(prompt) >= self.info.max_context:
            raise JobError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.info.max_context}"
            )
        req = GenerationRequest(
            prompt=prompt,
            max_tokens=job.max_tokens,
            sampling=SamplingParams(
                temperature=job.temperature,
                top_k=job.top_k,
                top_p=job.top_p,
                min_p=job.min_p,
                seed=job.seed,
            ),
            stop=job.stop,
        )
        n = 0
        for event in self.generator.run(req, cancelled):
            n += 1  # one event per sampled token, the end-of-sequence token included
            yield Delta(
                text=event.text,
                finish_reason=event.finish_reason,
                prompt_tokens=len(prompt),
                completion_tokens=n,
            )
