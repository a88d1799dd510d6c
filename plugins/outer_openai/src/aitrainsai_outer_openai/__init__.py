"""The openai outer trainer: a frozen agent behind an OpenAI-compatible endpoint."""
