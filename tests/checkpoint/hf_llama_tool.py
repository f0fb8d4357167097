#!/usr/bin/env python3
"""hf_llama_tool.py: an independent writer, reader and reference of Hugging Face Llama, Qwen2,
Qwen3, Qwen3-MoE, Mistral and Mixtral model directories, in plain Python (no numpy, torch or
safetensors package), for the HF Llama-family import and export test (test_hf_llama.sh).

  make DIR [--arch llama|qwen2|qwen3|qwen3_moe|mistral|mixtral] [--shards N] [--dtype bf16|f32]
       [--seed S] [--groups G] [--head-dim D] [--tied] [--bias] [--rope-scaling] [--theta BASE]
       [--no-norm-topk]
      A random tiny LlamaForCausalLM (Qwen2ForCausalLM: biases on q, k and v; Qwen3ForCausalLM:
      q_norm and k_norm; Qwen3MoeForCausalLM: those, layer 0 dense (mlp_only_layers [0]) and 4
      experts, the top 2 renormalized unless --no-norm-topk; MistralForCausalLM: sliding_window
      null) as save_pretrained writes it: config.json and safetensors (one file, or
      N shards listed by model.safetensors.index.json). --head-dim: head_dim in config.json, the
      q/k/v projections heads * D wide (default hidden / heads, no head_dim key for qwen2).
  count CONFIG_JSON
      The parameter count of the model a Hugging Face config.json describes, from the modules'
      definitions (embedding, attention with its q/k norms, dense and sparse MLPs, norms, head),
      and the parameters one token uses (the top k of each sparse layer's experts): "total active".
  greedy DIR PROMPT_IDS NEW
      The greedy continuation by the reference forward (float64, written from the Llama
      definitions: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), printed as
      tessera-generate prints ids: "prompt | new". Exits 3 if some step's two best logits are
      within 1e-3 (the comparison would then depend on rounding).
  compare A B
      Every tensor of A has the same name, dtype, shape and bytes in B, and B has no other one.
"""
import json
import math
import os
import random
import struct
import sys


# ---- safetensors -------------------------------------------------------------------------------

def read_file(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {name: (e["dtype"], e["shape"], data[base + e["data_offsets"][0]:base + e["data_offsets"][1]])
            for name, e in header.items()}


def read_dir(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_file(os.path.join(d, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out, files = {}, {}
    for name, file in weight_map.items():
        if file not in files:
            files[file] = read_file(os.path.join(d, file))
        out[name] = files[file][name]
    return out


def to_floats(dtype, raw):
    if dtype == "F32":
        return list(struct.unpack("<%df" % (len(raw) // 4), raw))
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % (len(raw) // 2), raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    if dtype == "F16":
        return list(struct.unpack("<%de" % (len(raw) // 2), raw))
    raise SystemExit("unsupported dtype " + dtype)


def bf16_bits(x):  # round to nearest even
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def encode(dtype, values):
    if dtype == "F32":
        return struct.pack("<%df" % len(values), *values)
    return struct.pack("<%dH" % len(values), *[bf16_bits(v) for v in values])


def write_file(path, tensors):  # tensors: list of (name, dtype, shape, raw)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, _, raw in tensors:
            f.write(raw)


# ---- make ----------------------------------------------------------------------------------------

def make(d, shards, dtype, seed, groups, tied, bias, scaling, theta, arch="llama", head_dim=0,
         vocab=100, positions=32, norm_topk=True):
    rng = random.Random(seed)
    h, heads, inter, layers = 16, 4, 24, 2
    hd = head_dim or h // heads
    if arch != "llama" and bias:
        raise SystemExit("--bias is Llama's attention_bias/mlp_bias (Qwen2 has q/k/v biases always)")
    qkv_bias = bias or arch == "qwen2"
    qwen3 = arch in ("qwen3", "qwen3_moe")
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM",
           "mixtral": "MixtralForCausalLM"}[arch]
    # Mixtral and Qwen3-MoE: 4 experts, the top 2 of each token
    experts = 4 if arch in ("mixtral", "qwen3_moe") else 0
    moe_inter = 12  # Qwen3-MoE's experts' width (moe_intermediate_size)
    cfg = {"architectures": [cls], "model_type": arch, "hidden_act": "silu",
           "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": groups,
           "max_position_embeddings": positions, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": theta, "attention_bias": bias,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
                           if scaling else None,
           "mlp_bias": bias, "tie_word_embeddings": tied,
           "torch_dtype": "bfloat16" if dtype == "BF16" else "float32"}
    if arch != "llama":
        del cfg["attention_bias"], cfg["mlp_bias"]
    if arch == "qwen2":  # as Qwen2.5's config.json: a window size that use_sliding_window turns off
        cfg.update({"use_sliding_window": False, "sliding_window": 32, "max_window_layers": layers})
    if qwen3:  # as Qwen3's config.json: head_dim always, no biases, no window
        cfg.update({"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": layers, "head_dim": hd})
    if arch == "qwen3_moe":
        cfg.update({"num_experts": experts, "num_experts_per_tok": 2,
                    "moe_intermediate_size": moe_inter, "norm_topk_prob": norm_topk,
                    "decoder_sparse_step": 1, "mlp_only_layers": [0],
                    "router_aux_loss_coef": 0.001, "output_router_logits": False})
    if arch in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if arch == "mixtral":
        cfg.update({"num_local_experts": experts, "num_experts_per_tok": 2,
                    "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
                    "output_router_logits": False})
    if head_dim:
        cfg["head_dim"] = head_dim
    tensors = []

    def add(name, shape, std=0.3, ones=False):
        n = 1
        for s in shape:
            n *= s
        vals = [1.0 + rng.gauss(0, 0.1) if ones else rng.gauss(0, std) for _ in range(n)]
        tensors.append((name, dtype, shape, encode(dtype, vals)))

    add("model.embed_tokens.weight", [vocab, h], 1.0)
    for l in range(layers):
        p = "model.layers.%d." % l
        add(p + "input_layernorm.weight", [h], ones=True)
        for proj, rows in (("q_proj", heads * hd), ("k_proj", groups * hd), ("v_proj", groups * hd)):
            add(p + "self_attn." + proj + ".weight", [rows, h])
            if qkv_bias:
                add(p + "self_attn." + proj + ".bias", [rows], 0.1)
        if qwen3:
            add(p + "self_attn.q_norm.weight", [hd], ones=True)
            add(p + "self_attn.k_norm.weight", [hd], ones=True)
        add(p + "self_attn.o_proj.weight", [h, heads * hd])
        if bias:
            add(p + "self_attn.o_proj.bias", [h], 0.1)
        add(p + "post_attention_layernorm.weight", [h], ones=True)
        if arch == "qwen3_moe" and l != 0:  # the router (mlp.gate), each expert a Llama MLP
            add(p + "mlp.gate.weight", [experts, h], 1.0)
            for e in range(experts):
                for proj, shape in (("gate_proj", [moe_inter, h]), ("up_proj", [moe_inter, h]),
                                    ("down_proj", [h, moe_inter])):
                    add(p + "mlp.experts.%d.%s.weight" % (e, proj), shape)
            continue
        if experts and arch == "mixtral":  # Mixtral's sparse block: the router (gate), each w1, w2, w3
            add(p + "block_sparse_moe.gate.weight", [experts, h], 1.0)
            for e in range(experts):
                for w, shape in (("w1", [inter, h]), ("w2", [h, inter]), ("w3", [inter, h])):
                    add(p + "block_sparse_moe.experts.%d.%s.weight" % (e, w), shape)
            continue
        for proj, shape in (("gate_proj", [inter, h]), ("up_proj", [inter, h]), ("down_proj", [h, inter])):
            add(p + "mlp." + proj + ".weight", shape)
            if bias:
                add(p + "mlp." + proj + ".bias", [shape[0]], 0.1)
    add("model.norm.weight", [h], ones=True)
    if not tied:
        add("lm_head.weight", [vocab, h], 0.5)
    write_dir(d, cfg, tensors, shards)


def write_dir(d, cfg, tensors, shards):
    """config.json and the tensors as save_pretrained writes them: model.safetensors, or `shards`
    files listed by model.safetensors.index.json."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if shards == 1:
        write_file(os.path.join(d, "model.safetensors"), tensors)
        return
    per = (len(tensors) + shards - 1) // shards
    weight_map, total = {}, 0
    for k in range(shards):
        name = "model-%05d-of-%05d.safetensors" % (k + 1, shards)
        part = tensors[k * per:(k + 1) * per]
        write_file(os.path.join(d, name), part)
        for t in part:
            weight_map[t[0]] = name
            total += len(t[3])
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---- the reference forward ------------------------------------------------------------------------

def load_model(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    w = {n: (to_floats(dt, raw), shape) for n, (dt, shape, raw) in read_dir(d).items()}
    return cfg, w


def logits_of(cfg, w, ids):
    h, H = cfg["hidden_size"], cfg["num_attention_heads"]
    G = cfg.get("num_key_value_heads") or H
    hd, inter, eps = cfg.get("head_dim") or h // H, cfg["intermediate_size"], cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 10000.0)
    T = len(ids)
    inv_freq = [theta ** (-2.0 * i / hd) for i in range(hd // 2)]
    sc = cfg.get("rope_scaling")
    if sc:  # Llama 3: slow the long wavelengths, keep the short ones, blend between
        f, lo, hi, old = (sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                          sc["original_max_position_embeddings"])
        scaled = []
        for inv in inv_freq:
            wl = 2 * math.pi / inv
            if wl < old / hi:
                scaled.append(inv)
            elif wl > old / lo:
                scaled.append(inv / f)
            else:
                s = (old / wl - lo) / (hi - lo)
                scaled.append((1 - s) * inv / f + s * inv)
        inv_freq = scaled

    def W(name):
        return w[name][0]

    def linear(x, name, rows):
        m = W(name + ".weight")
        b = W(name + ".bias") if name + ".bias" in w else None
        cols = len(x)
        return [sum(m[r * cols + c] * x[c] for c in range(cols)) + (b[r] if b else 0.0)
                for r in range(rows)]

    def rmsnorm(x, name):
        g = W(name)
        s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
        return [x[i] * s * g[i] for i in range(len(x))]

    def head_norms(vec, name):  # Qwen3: RMSNorm over each head's hd features
        if name not in w:
            return vec
        out = []
        for head in range(len(vec) // hd):
            out += rmsnorm(vec[head * hd:(head + 1) * hd], name)
        return out

    def swiglu_mlp(a, prefix, gate, up, down, width):
        g = linear(a, prefix + gate, width)
        u = linear(a, prefix + up, width)
        act = [g[i] / (1.0 + math.exp(-g[i])) * u[i] for i in range(width)]
        return linear(act, prefix + down, h)

    def rope(vec, t):  # rotate_half on each head of vec
        out = list(vec)
        for head in range(len(vec) // hd):
            o = head * hd
            for i in range(hd // 2):
                a = t * inv_freq[i]
                x1, x2 = vec[o + i], vec[o + i + hd // 2]
                out[o + i] = x1 * math.cos(a) - x2 * math.sin(a)
                out[o + i + hd // 2] = x2 * math.cos(a) + x1 * math.sin(a)
        return out

    emb = W("model.embed_tokens.weight")
    x = [emb[i * h:(i + 1) * h] for i in ids]
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        q, k, v = [], [], []
        for t in range(T):
            a = rmsnorm(x[t], p + "input_layernorm.weight")
            qn, kn = p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"
            q.append(rope(head_norms(linear(a, p + "self_attn.q_proj", H * hd), qn), t))
            k.append(rope(head_norms(linear(a, p + "self_attn.k_proj", G * hd), kn), t))
            v.append(linear(a, p + "self_attn.v_proj", G * hd))
        for t in range(T):
            att = [0.0] * (H * hd)
            for hh in range(H):
                g = hh // (H // G)
                s = [sum(q[t][hh * hd + e] * k[u][g * hd + e] for e in range(hd)) / math.sqrt(hd)
                     for u in range(t + 1)]
                m = max(s)
                z = sum(math.exp(si - m) for si in s)
                for u in range(t + 1):
                    pu = math.exp(s[u] - m) / z
                    for e in range(hd):
                        att[hh * hd + e] += pu * v[u][g * hd + e]
            y = linear(att, p + "self_attn.o_proj", h)
            x[t] = [x[t][c] + y[c] for c in range(h)]
        for t in range(T):
            a = rmsnorm(x[t], p + "post_attention_layernorm.weight")
            if p + "mlp.gate.weight" in w:  # Qwen3-MoE: softmax over all, top k (renormalized)
                E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
                z = linear(a, p + "mlp.gate", E)
                m = max(z)
                prob = [math.exp(zi - m) for zi in z]
                total = sum(prob)
                prob = [pz / total for pz in prob]
                top = sorted(range(E), key=lambda e: -prob[e])[:K]
                norm = sum(prob[e] for e in top) if cfg.get("norm_topk_prob") else 1.0
                y = [0.0] * h
                for e in top:
                    ye = swiglu_mlp(a, p + "mlp.experts.%d." % e, "gate_proj", "up_proj",
                                    "down_proj", cfg["moe_intermediate_size"])
                    y = [y[c] + prob[e] / norm * ye[c] for c in range(h)]
            elif "num_local_experts" in cfg:  # Mixtral: softmax over all, top k, renormalized
                E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
                z = linear(a, p + "block_sparse_moe.gate", E)
                m = max(z)
                prob = [math.exp(zi - m) for zi in z]
                top = sorted(range(E), key=lambda e: -prob[e])[:K]
                norm = sum(prob[e] for e in top)
                y = [0.0] * h
                for e in top:
                    q = p + "block_sparse_moe.experts.%d." % e
                    gate = linear(a, q + "w1", inter)
                    up = linear(a, q + "w3", inter)
                    act = [gate[i] / (1.0 + math.exp(-gate[i])) * up[i] for i in range(inter)]
                    ye = linear(act, q + "w2", h)
                    y = [y[c] + prob[e] / norm * ye[c] for c in range(h)]
            else:
                gate = linear(a, p + "mlp.gate_proj", inter)
                up = linear(a, p + "mlp.up_proj", inter)
                act = [gate[i] / (1.0 + math.exp(-gate[i])) * up[i] for i in range(inter)]
                y = linear(act, p + "mlp.down_proj", h)
            x[t] = [x[t][c] + y[c] for c in range(h)]
    last = rmsnorm(x[-1], "model.norm.weight")
    head = W("lm_head.weight") if "lm_head.weight" in w else emb
    V = cfg["vocab_size"]
    return [sum(head[r * h + c] * last[c] for c in range(h)) for r in range(V)]


def count(path):
    with open(path) as f:
        c = json.load(f)
    h, H, L, V = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["vocab_size"]
    G = c.get("num_key_value_heads") or H
    hd = c.get("head_dim") or h // H
    qwen3 = c["model_type"] in ("qwen3", "qwen3_moe")
    attn = h * H * hd + 2 * h * G * hd + H * hd * h + (2 * hd if qwen3 else 0)  # q, k, v, o, norms
    if c.get("attention_bias"):
        attn += H * hd + 2 * G * hd + h
    dense = 3 * h * c["intermediate_size"]
    total = active = V * h + h  # embedding, final norm
    if not c.get("tie_word_embeddings", False):
        total += V * h
        active += V * h
    E = c.get("num_experts") or c.get("num_local_experts") or 0
    for l in range(L):
        layer = attn + 2 * h  # attention and its two norms
        sparse = E > 0 and l not in (c.get("mlp_only_layers") or []) and \
            (l + 1) % c.get("decoder_sparse_step", 1) == 0
        if sparse:
            width = c.get("moe_intermediate_size") or c["intermediate_size"]
            total += layer + E * h + E * 3 * h * width
            active += layer + E * h + c["num_experts_per_tok"] * 3 * h * width
        else:
            total += layer + dense
            active += layer + dense
    print("%d %d" % (total, active))


def greedy(d, prompt, new):
    cfg, w = load_model(d)
    ids = [int(t) for t in prompt.split()]
    out = []
    for _ in range(new):
        lg = logits_of(cfg, w, ids + out)
        order = sorted(range(len(lg)), key=lambda i: -lg[i])
        if lg[order[0]] - lg[order[1]] < 1e-3:
            print("tie within 1e-3 between ids %d and %d" % (order[0], order[1]), file=sys.stderr)
            sys.exit(3)
        out.append(order[0])
    print(" ".join(map(str, ids)) + " | " + " ".join(map(str, out)))


def compare(a, b):
    ta, tb = read_dir(a), read_dir(b)
    bad = sorted(set(ta) ^ set(tb))
    for n in sorted(set(ta) & set(tb)):
        if ta[n] != tb[n]:
            bad.append(n)
    if bad:
        print("differ: " + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
        sys.exit(1)
    print("%d tensors identical (names, dtypes, shapes, bytes)" % len(ta))


def main(argv):
    if len(argv) >= 2 and argv[0] == "make":
        opts = {"--shards": "1", "--dtype": "bf16", "--seed": "1", "--groups": "2",
                "--theta": "500000", "--arch": "llama", "--head-dim": "0", "--vocab": "100",
                "--positions": "32"}
        flags = set()
        i = 2
        while i < len(argv):
            if argv[i] in ("--tied", "--bias", "--rope-scaling", "--no-norm-topk"):
                flags.add(argv[i])
                i += 1
            else:
                opts[argv[i]] = argv[i + 1]
                i += 2
        make(argv[1], int(opts["--shards"]), opts["--dtype"].upper(), int(opts["--seed"]),
             int(opts["--groups"]), "--tied" in flags, "--bias" in flags,
             "--rope-scaling" in flags, float(opts["--theta"]), opts["--arch"],
             int(opts["--head-dim"]), int(opts["--vocab"]), int(opts["--positions"]),
             "--no-norm-topk" not in flags)
    elif len(argv) == 4 and argv[0] == "greedy":
        greedy(argv[1], argv[2], int(argv[3]))
    elif len(argv) == 2 and argv[0] == "count":
        count(argv[1])
    elif len(argv) == 3 and argv[0] == "compare":
        compare(argv[1], argv[2])
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
