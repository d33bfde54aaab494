"""Model sources: the built-in SmolLM2-135M, Hugging Face folders, GGUF files, from-scratch Llamas."""

from memascend.models.loading import ModelSource, build_model, load_tokenizer, resolve_model

__all__ = ["ModelSource", "resolve_model", "load_tokenizer", "build_model"]
