"""Weights in and out of the model: checkpoints of this repo and nanoGPT's (load.py), Hugging Face GPT-2 folders
(hf.py) and LoRA adapters (lora.py). `python -m weights` converts between them."""
