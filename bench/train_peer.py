#!/usr/bin/env python3
"""train_peer.py: the PyTorch peer of bench_gpu_train, measured in the same run on the GPU machine.
A GPT-2 (pre-LayerNorm, GELU, tied embeddings, vocabulary 50,304) trained with AdamW under bf16
autocast, scaled_dot_product_attention (causal) and, unless --eager, torch.compile: the setup of
issue 12's peer. Prints tokens/s and MFU with Megatron's FLOP count (72 L h^2 + 12 L s h + 6 h V per
token), the convention of bench_gpu_train.
Usage: train_peer.py [124m|1.3b] [steps=10] [micro_batch=16|8] [--eager]; exits 0 without
PyTorch or a GPU (nothing to compare)."""
import math
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("train_peer.py: PyTorch is not installed here; no peer figures")
    sys.exit(0)

SHAPES = {"124m": (12, 768, 12, 1024, 16), "1.3b": (24, 2048, 16, 2048, 8)}
VOCAB = 50304
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (y.view(b, t, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    eager = "--eager" in sys.argv
    name = args[0] if args else "124m"
    if name not in SHAPES:
        sys.exit(f"train_peer.py: error: unknown model '{name}' (allowed: 124m, 1.3b)")
    layers, h, heads, seq, mbs = SHAPES[name]
    steps = int(args[1]) if len(args) > 1 else 10
    mbs = int(args[2]) if len(args) > 2 else mbs
    if not torch.cuda.is_available():
        print("train_peer.py: no GPU here; no peer figures")
        return
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(layers, h, heads, seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = model if eager else torch.compile(model)
    idx = torch.randint(0, VOCAB, (mbs, seq), device="cuda")
    tgt = torch.randint(0, VOCAB, (mbs, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for _ in range(3):  # compilation and warm-up
        step()
    torch.cuda.synchronize()
    warm = time.time() - t0
    t0 = time.time()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    sec = (time.time() - t0) / steps
    tokens = mbs * seq / sec
    flops = 72 * layers * h * h + 12 * layers * seq * h + 6 * h * VOCAB
    dev = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in dev), 0.0)
    tflops = tokens * flops / 1e12
    mfu = f", {100 * tflops / peak:.1f}% MFU" if peak else ""
    print(f"{name}: PyTorch {torch.__version__} {'eager' if eager else 'torch.compile'} bf16 on {dev}, "
          f"micro-batch {mbs}, seq {seq}: {tokens:,.0f} tokens/s, {tflops:.1f} TFLOP/s{mfu} "
          f"({sec * 1e3:.1f} ms/step, warm-up {warm:.0f} s, loss {loss.item():.3f}, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)")
    if not math.isfinite(loss.item()):
        sys.exit("train_peer.py: error: the loss is not finite")


if __name__ == "__main__":
    main()
