# nanoGPT's "baby GPT": a 10.7M-parameter character model on Shakespeare for one GPU
# (a few minutes on an A100/H100).   python train.py config/train_shakespeare_char_gpu.py

out_dir = "out-shakespeare-char-gpu"
eval_interval = 250  # it overfits: evaluate often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # only save when val improves

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # 256 characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
