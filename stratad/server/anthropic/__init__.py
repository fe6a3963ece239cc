"""Anthropic's Messages API: its request types and their jobs (`requests`), its answers and
streamed events (`answers`), its routes (`routes`)."""
