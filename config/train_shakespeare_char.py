# The embedded default: a small character-level GPT on Shakespeare's complete works that trains on a
# 2-core CPU in about two minutes. These are TrainConfig's own defaults, written out so you can copy
# and edit them (tests/unit/test_train.py checks the two agree).
# Config files are Python and are run like any script you run: only use files you trust.

out_dir = "out-shakespeare-char"
eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64  # characters of context

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False

learning_rate = 2e-3  # small models can take a high learning rate
max_iters = 2000
lr_decay_iters = 2000  # usually = max_iters
min_lr = 1e-4
beta2 = 0.99  # a little higher than GPT-2's 0.95: few tokens per step
warmup_iters = 100
