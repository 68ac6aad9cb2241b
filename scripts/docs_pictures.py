"""Make the pictures of the documentation site from real runs of the embedded model.

``docs/assets/run-rtn-int4.png``: the getting-started page's run (SmolLM2-135M-Instruct, two prompts,
8 new tokens, greedy, ``rtn-int4`` keys and values, the certified gate at ``tau = 0.2``), drawn by
``Monitor.plot``. One torch thread, so the picture is the same on every run of the same machine.

Usage::

    python scripts/docs_pictures.py
"""
from pathlib import Path

import torch

import witcert
from witcert.integrations.hf.default_model import load_model

ASSETS = Path(__file__).resolve().parent.parent / "docs" / "assets"
PROMPTS = ["The capital of France is", "Water boils at"]


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    tok.padding_side = "left"
    inputs = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad(), witcert.monitor(model, scheme="rtn-int4", gate=witcert.Gate(tau=0.2)) as mon:
        model.generate(**inputs, max_new_tokens=8, do_sample=False)
    path = ASSETS / "run-rtn-int4.png"
    mon.plot(path)
    print(f"wrote {path.relative_to(ASSETS.parent.parent)}")


if __name__ == "__main__":
    main()
