# Evaluate OpenAI's gpt2-large (774M parameters; n_layer=36, n_head=20, n_embd=1280) on OpenWebText, as nanoGPT's
# config/eval_gpt2_large.py does:
#   python -m data.openwebtext.prepare
#   python train.py config/eval_gpt2_large.py
# The model takes its shape and its 1024-token context from the weights; eval_only writes nothing.

batch_size = 8
eval_iters = 500  # use more iterations to get a good estimate
eval_only = True
wandb_log = False
init_from = "gpt2-large"
dataset = "openwebtext"
