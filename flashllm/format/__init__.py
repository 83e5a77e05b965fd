"""The model directory's formats: manifest, architecture spec, FFN and expert layouts, quantization, safetensors."""
