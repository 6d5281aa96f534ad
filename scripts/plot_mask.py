"""Draw the attention masks of MARS (docs/spec.md §3, §4) as a picture: results/mask.png.

Panels, each drawn from the very tensor the code uses (True = query row may attend key column):
  1. mars.mars_attention_mask(l, B): the training mask over [clean | noisy];
  2. the same with bidirectional=True: the "Block Diffusion style" ablation (§4);
  3. mars.exact_attention_mask(K, K): one step of exact mode (exact.py).
The example row has a prompt of --prompt tokens: they stay real in the noisy stream (§3),
every later position there is <|mask|> ("M"). Colours: clean -> clean (ordinary causal),
noisy -> clean (earlier blocks' clean tokens), noisy -> noisy (own block). Dashed lines are
block boundaries, the solid line splits the two streams.

    python -m scripts.plot_mask                     # l = 8, B = 4 -> results/mask.png
    python -m scripts.plot_mask --l 12 --block-size 4 --prompt 5 --out mask.png
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import mars  # noqa: E402
from util.atomic import atomic_write  # noqa: E402

WHITE = (1.0, 1.0, 1.0)
COLOURS = {"clean->clean": (0.27, 0.51, 0.71), "noisy->clean": (0.96, 0.6, 0.2),
           "noisy->noisy": (0.3, 0.69, 0.29)}


def draw(ax, allowed, region, labels, cuts, strong, title):
    """allowed (T, T) bool; region(q, k) -> colour name; labels per index; cuts: dashed lines
    before these indices, strong: solid lines."""
    T = allowed.shape[0]
    img = np.ones((T, T, 3))
    for q in range(T):
        for k in range(T):
            img[q, k] = COLOURS[region(q, k)] if allowed[q, k] else WHITE
    ax.imshow(img, interpolation="nearest")
    ax.set_xticks(range(T), labels, fontsize=7, rotation=90)
    ax.set_yticks(range(T), labels, fontsize=7)
    ax.xaxis.tick_top()
    ax.set_xticks(np.arange(-0.5, T), minor=True)
    ax.set_yticks(np.arange(-0.5, T), minor=True)
    ax.grid(which="minor", color="0.85", lw=0.5)
    ax.tick_params(which="minor", length=0)
    for c in cuts:
        ax.axvline(c - 0.5, color="0.3", lw=0.8, ls="--")
        ax.axhline(c - 0.5, color="0.3", lw=0.8, ls="--")
    for c in strong:
        ax.axvline(c - 0.5, color="k", lw=1.8)
        ax.axhline(c - 0.5, color="k", lw=1.8)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("key", fontsize=8)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("query", fontsize=8)


def training_panel(ax, l, B, prompt, bidirectional):
    allowed = mars.mars_attention_mask(l, B, bidirectional).numpy()
    labels = [f"x{i}" for i in range(l)] + [f"x{i}" if i < prompt else f"M{i}" for i in range(l)]
    region = lambda q, k: "clean->clean" if q < l else ("noisy->clean" if k < l else "noisy->noisy")
    cuts = [s * l + b for s in (0, 1) for b in range(B, l, B)]
    name = "Block-Diffusion style (bidirectional in a block)" if bidirectional else "MARS training mask"
    draw(ax, allowed, region, labels, cuts, [l],
         f"{name}\n[clean | noisy], l={l}, B={B}, prompt x0..x{prompt - 1}")
    for i, name in enumerate(("clean stream", "noisy stream")):
        ax.text((i + 0.5) * l - 0.5, 2 * l - 0.3, name, ha="center", va="top", fontsize=8)


def exact_panel(ax, K):
    allowed = mars.exact_attention_mask(K, K).numpy()
    n_real = K + 1
    labels = ["c0"] + [f"d{i}" for i in range(1, K + 1)] + [f"G{j}m{m}" for j in range(K + 1)
                                                            for m in range(K)]
    region = lambda q, k: "clean->clean" if q < n_real else ("noisy->clean" if k < n_real else "noisy->noisy")
    draw(ax, allowed, region, labels, [n_real + j * K for j in range(1, K + 1)], [n_real],
         f"exact mode, one step: K={K} drafts, groups of g={K} masks\n(the cached prefix is visible to all)")


def plot_masks(path, l=8, block_size=4, prompt=3):
    """Write the figure to `path`; returns the panel titles drawn."""
    fig, axes = plt.subplots(1, 3, figsize=(5.6 * 3, 6.6), layout="constrained")
    training_panel(axes[0], l, block_size, prompt, False)
    training_panel(axes[1], l, block_size, prompt, True)
    exact_panel(axes[2], min(3, block_size))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, ["clean -> clean / real -> real (causal)", "noisy -> clean / mask -> real",
                         "noisy -> noisy / mask -> mask (own block or group)"],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), "wb")
    plt.close(fig)
    return [ax.get_title() for ax in axes]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--l", type=int, default=8, help="row length (a multiple of B)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--prompt", type=int, default=3, help="prompt tokens (stay real in the noisy stream)")
    p.add_argument("--out", default="results/mask.png")
    a = p.parse_args()
    plot_masks(a.out, a.l, a.block_size, a.prompt)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
