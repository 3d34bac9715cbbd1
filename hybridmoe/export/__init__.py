"""Writing GGUF files that llama.cpp loads: a Hugging Face layout (a checkpoint directory, or the
random tensors of a benchmark model) streamed tensor by tensor into llama.cpp's names, layout,
metadata, tokenizer and quantisation mixes (gguf_export.py is the entry point)."""
