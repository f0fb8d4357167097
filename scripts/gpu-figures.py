#!/usr/bin/env python3
"""gpu-figures.py: issue 37's table of figures (point 4) from the logs of one scripts/gpu-lease.sh
run: each figure of Tessera beside the peer's of the same run and the "to resolve" bar, and
whether it is met. Figures a run did not measure print as "-".

Usage: python3 scripts/gpu-figures.py LOGS_DIR   (gpu-lease.sh's logs folder: one subfolder and
one NAME.out per step)
"""
import pathlib
import re
import sys


def read(root, *names):
    text = ""
    for n in names:
        for p in sorted(root.glob(n)):
            text += p.read_text(errors="replace")
    return text


def num(s):
    return float(s.replace(",", ""))


def first(pattern, text):
    m = re.search(pattern, text, re.M)
    return m.groups() if m else None


def main():
    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_dir():
        print("usage: gpu-figures.py LOGS_DIR (the logs folder of scripts/gpu-lease.sh)",
              file=sys.stderr)
        return 2
    root = pathlib.Path(sys.argv[1])
    rows = []  # (figure, ours, peer, to resolve, met: True/False/None)

    b124 = read(root, "bench-124m/*.log", "bench-124m.out")
    peer = read(root, "peer-124m.out")
    ours = first(r"^124m\s*:.*\|\s*([\d.]+) ms/step \|\s*(\d+) tokens/s", b124)
    theirs = first(r"^124m: PyTorch.*?: ([\d,]+) tokens/s", peer)
    ratio = num(ours[1]) / num(theirs[0]) if ours and theirs else None
    rows.append(("GPT-2 124M, seq 1024, mb 16 (tokens/s)",
                 f"{int(ours[1]):,} ({ours[0]} ms)" if ours else "-",
                 f"{int(num(theirs[0])):,} (torch.compile)" if theirs else "-",
                 ">= 1.0x the peer",
                 None if ratio is None else ratio >= 1.0,
                 f"{ratio:.3f}x" if ratio else ""))

    b13 = read(root, "bench-1.3b/*.log", "bench-1.3b.out")
    mfu = first(r"^1\.3b\s*:.*\|\s*([\d.]+) ms/step.*MFU ([\d.]+)%", b13)
    rows.append(("1.3B, seq 2048, mb 8 (MFU)", f"{mfu[1]} % ({mfu[0]} ms)" if mfu else "-",
                 "48.4 % (issue 12, H100)", ">= 50 %",
                 None if not mfu else float(mfu[1]) >= 50.0, ""))

    att = read(root, "attention/bench-attention.log", "fused/*.log")
    apeer = read(root, "attention/bench-attention-peer.log")
    for shape, pshape in (("B16 H12 G12 T1024 D64", "B16 H12 T1024 D64"),
                          ("B8 H16 G16 T2048 D128", "B8 H16 T2048 D128")):
        pat = r"^{} {}\s*: forward [\d.]+ ms ([\d.]+) TFLOP/s \| backward [\d.]+ ms ([\d.]+)"
        ppat = r"^{} {}: forward [\d.]+ ms ([\d.]+) TFLOP/s \| backward [\d.]+ ms ([\d.]+)"
        for ours_name, peer_name, bar in (("fused", "cudnn", 0.95), ("flash", "flash", 1.0)):
            o = first(pat.format(re.escape(shape), ours_name), att)
            p = first(ppat.format(re.escape(pshape), peer_name), apeer)
            met = None
            if o and p:
                met = all(float(a) >= bar * float(b) for a, b in zip(o, p))
            rows.append((f"attention {ours_name} {pshape} (fwd / bwd TFLOP/s)",
                         f"{o[0]} / {o[1]}" if o else "-",
                         f"{p[0]} / {p[1]} (SDPA {peer_name})" if p else "-",
                         "within 5 % of cuDNN SDPA" if ours_name == "fused"
                         else ">= SDPA flash", met, ""))

    mix = read(root, "mixtral/*.log", "mixtral.out")
    m = first(r"^mixtral\s*:.*\|\s*([\d.]+) ms/step.*MFU ([\d.]+)%", mix)
    rows.append(("Mixtral-shaped MoE step (MFU, active)", f"{m[1]} % ({m[0]} ms)" if m else "-",
                 "-", "its prediction +-20 % (goal 40 %)", None, ""))

    gen = read(root, "generate/*.log", "generate.out")
    d = first(r"^decode tokens/s, batch 1, 256 new\s+(\d+)", gen)
    rows.append(("decode GPT-2 124M bf16, batch 1 (tokens/s)", f"{int(d[0]):,}" if d else "-",
                 "transformers 157 (H100)", ">= 2,000", None if not d else int(d[0]) >= 2000,
                 ""))

    device = read(root, "*/device.txt").strip().splitlines()
    print(f"=== issue 37 point 4 ({device[0] if device else 'device unknown'}) ===")
    w = max(len(r[0]) for r in rows)
    print(f"{'figure':<{w}}  {'Tessera':<22} {'peer, same run':<34} {'to resolve':<26} met")
    for fig, o, p, bar, met, note in rows:
        flag = "-" if met is None else ("yes" if met else "NO")
        print(f"{fig:<{w}}  {o:<22} {p:<34} {bar:<26} {flag} {note}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
