#!/usr/bin/env python3
"""attention_peer.py: the peer figures for bench_attention, measured in the same run on the GPU
machine: PyTorch's scaled_dot_product_attention (causal) with the flash and cuDNN backends, same
shapes and FLOP convention (forward 4*B*H*T^2*D/2, backward 2.5x). Prints one line per shape and
backend; exits 0 without PyTorch (nothing to compare)."""
import sys

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    print("attention_peer.py: PyTorch is not installed here; no peer figures")
    sys.exit(0)

SHAPES = [(16, 12, 1024, 64), (8, 16, 2048, 128)]
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def timed(fn):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS / 1e3


def main():
    if not torch.cuda.is_available():
        print("attention_peer.py: no CUDA device")
        return
    print(f"attention_peer.py: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16")
    for b, h, t, d in SHAPES:
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * b * h * t * t * d / 2
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fwd = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True))
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                    bwd = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
                print(f"B{b} H{h} T{t} D{d} {name}: forward {fwd*1e3:.3f} ms "
                      f"{flops/fwd/1e12:.1f} TFLOP/s | backward {bwd*1e3:.3f} ms "
                      f"{2.5*flops/bwd/1e12:.1f} TFLOP/s")
            except RuntimeError as e:
                print(f"B{b} H{h} T{t} D{d} {name}: unavailable ({str(e).splitlines()[0]})")


if __name__ == "__main__":
    main()
