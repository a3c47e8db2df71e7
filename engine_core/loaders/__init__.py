"""Where weights come from, apart from what a model does with them.

A loader yields `(name, tensor)` pairs under the Hugging Face checkpoint's
names: safetensors.py reads checkpoint directories, gguf.py GGUF files
(dequantized, llama.cpp's q/k permutation undone), ctranslate2.py
CTranslate2 `model.bin` directories (Whisper; fused projections split),
compressed_tensors.py int8 checkpoints in vLLM's compressed-tensors format
(dequantized; their int8 weights as stored for `--quantization int8`); checkpoint.py's
`weight_pairs` picks one by the checkpoint's format. Each model class has
one `load_weights(pairs)`. A new format is one module here and one branch in
`weight_pairs`. gguf_cache.py (no torch) also serves model_config.py.
"""
