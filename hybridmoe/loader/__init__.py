"""Loading models: a Hugging Face directory or a GGUF file -> our model, its tokenizer,
its experts."""

from hybridmoe.loader.load import load_model, load_tokenizer, model_config  # noqa: F401
