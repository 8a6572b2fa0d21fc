"""The greedy text each in-graph path should give, computed in torch.

    python bench/checks/ingraph_greedy_reference.py CHECKPOINT [--cells 13:4 13:32 1:4]
        [--device cuda] [--tokens 48] [--prompt "w100 w200 w300"]

For each theta (G:R) of a Gemma 3 checkpoint, runs transformers' Gemma 3 in
bf16 with the projections served four ways and prints the greedy
continuation of the harness's prompt (``serve_benchmark.py``'s greedy check):

- ``precompute-outside``: the W_eff ``attnquant.load.precompute.precompute_outside`` serves;
- ``graph-fold``: ``s*W0 + U V^T`` with each operation rounded to bf16;
- ``gemm``: ``s*(x W0^T) + (x V) U^T``, each product rounded to bf16 (MAX's
  matmuls and the elementwise ops in the model dtype);
- ``generated``: the same sum in float32 with float32 factors, rounded once
  (what ``generated_linear`` computes).

They differ only in rounding. If they agree here and a served path's text
differs, that path computes something else on that device; if they disagree
here, the model is too close to a tie for the texts to say anything. Also
prints the margin between the first token's top two logits. Run it on the
device that made the checkpoint: the random recipe draws on that device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnquant.load.checkpoint import load_state_dict  # noqa: E402
from attnquant.config import AttnQuantConfig  # noqa: E402
from attnquant.formats.names import ProjectionKey, find_projections  # noqa: E402
from attnquant.load.precompute import precompute_outside  # noqa: E402
from attnquant.formats.theta import ThetaBundle, build_theta  # noqa: E402

PATHS = ("precompute-outside", "graph-fold", "gemm", "generated")


class DenseProjection(torch.nn.Module):
    """``y = x W^T`` for a W already in its served form."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class ThetaProjection(torch.nn.Module):
    """``y = s*(x W0^T) + (x V) U^T`` with the GEMM path's or the generated op's rounding."""

    def __init__(self, w0: torch.Tensor, scale: torch.Tensor, u: torch.Tensor, v: torch.Tensor, exact: bool):
        super().__init__()
        factor = torch.float32 if exact else w0.dtype
        self.w0, self.exact = w0, exact
        self.scale, self.u, self.v = scale.to(factor), u.to(factor), v.to(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            xf = x.float()
            return (self.scale * (xf @ self.w0.float().T) + (xf @ self.v) @ self.u.T).to(x.dtype)
        return (x @ self.w0.T) * self.scale + (x @ self.v) @ self.u.T


def serve(model: torch.nn.Module, keys: list[ProjectionKey], theta: ThetaBundle, path: str,
          dense: dict[str, torch.Tensor], device: str) -> None:  # fmt: skip
    """Replaces every projection of ``model`` by the form ``path`` computes
    (all of them, so one loaded model serves every path in turn)."""
    bf16 = torch.bfloat16
    for key in keys:
        layer = theta.layers[(key.proj.removesuffix("_proj"), key.layer)]
        w0 = theta.shared[layer.group].to(device, bf16)
        scale, u, v = (t.to(device) for t in (layer.scale, layer.u, layer.v))
        if path == "precompute-outside":
            module = DenseProjection(dense[key.weight_name].to(device, bf16))
        elif path == "graph-fold":
            module = DenseProjection(scale.to(bf16)[:, None] * w0 + u.to(bf16) @ v.to(bf16).T)
        else:
            module = ThetaProjection(w0, scale, u, v, exact=path == "generated")
        setattr(model.get_submodule(key.weight_name.rsplit(".", 2)[0]), key.proj, module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--cells", nargs="+", default=["13:4", "13:32", "1:4"], help="G:R per theta")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt", default="w100 w200 w300")
    args = parser.parse_args()

    from transformers import AutoTokenizer, Gemma3ForCausalLM

    checkpoint = load_state_dict(args.checkpoint)
    keys = find_projections(checkpoint)
    num_layers = 1 + max(key.layer for key in keys)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(args.device)
    model = Gemma3ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).to(args.device)
    for cell in args.cells:
        blocks, rank = (int(part) for part in cell.split(":"))
        theta = build_theta({k: checkpoint[k.weight_name] for k in keys}, blocks=blocks, rank=rank,
                            num_layers=num_layers)  # fmt: skip
        config = AttnQuantConfig(blocks=blocks, rank=rank, cache=False)
        dense = precompute_outside(checkpoint, config, progress=False).state_dict
        for path in PATHS:
            serve(model, keys, theta, path, dense, args.device)
            with torch.no_grad():
                top = torch.topk(model(ids).logits[0, -1].float(), 2).values
                out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
            text = tokenizer.decode(out[0, ids.shape[1]:])
            print(f"G={blocks} R={rank} {path:18s} margin {float(top[0] - top[1]):.3f} |{text}", flush=True)


if __name__ == "__main__":
    main()
