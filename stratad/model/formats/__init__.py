"""Reading model files: GGUF (tensors and metadata), Hugging Face directories, and the
shape check every loaded model passes."""
