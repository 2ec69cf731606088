"""Models built on ``fast_attention``: a Llama-architecture decoder
(``llama``) and its loader from GGUF files (``gguf``)."""
