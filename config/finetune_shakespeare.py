# Fine-tune a GPT-2 124M checkpoint (from config/train_gpt2.py) on Shakespeare with GPT-2 BPE tokens:
#   python -m data.shakespeare.prepare
#   python train.py config/finetune_shakespeare.py --init_from=out-gpt2/ckpt.pt
# init_from takes the weights only: the optimizer, step count and schedule start fresh.

out_dir = "out-shakespeare"
init_from = "out-gpt2/ckpt.pt"
eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False

dataset = "shakespeare"
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024

# the model's shape (12 layers x 768, biases, its vocabulary) is the checkpoint's
dropout = 0.1

learning_rate = 3e-5  # a constant, small learning rate
decay_lr = False
max_iters = 20
