"""Model sources: the built-in SmolLM2-135M, Hugging Face folders, GGUF files, from-scratch Llamas."""

from memascend.models.loading import ModelSource, load_tokenizer, resolve_model, build_model

__all__ = ["ModelSource", "resolve_model", "load_tokenizer", "build_model"]
