"""A model's text side: its tokenizer (read from GGUF metadata or tokenizer.json), chat
template, tool-call prompts and fill-in-the-middle tokens."""
