#!/usr/bin/env python3
"""The per-row error distribution behind ``reference.ROW_TOLERANCE``, from a saved e2e run.

    PYTHONPATH=$PWD/src:$PWD/testbed $PY -m speculators_compat_testbed.e2e_runner --arch llama --out r.json --save-tensors r.pt
    PYTHONPATH=$PWD/src $PY scripts/row_error_distribution.py r.pt

Prints, over every row (token) of every sequence and captured layer: the quantiles of the correct
rows' relative error against the reference, and - what a wrong row would score - the error of
the neighbouring token's reference row in each row's place (a duplicated or shifted row), split
by whether the two neighbouring token ids differ. A zeroed row scores exactly 1.
"""

from __future__ import annotations

import sys

import torch

from speculators_compat_testbed.reference import row_errors


def main(paths: list[str]) -> int:
    for path in paths:
        d = torch.load(path, weights_only=False)
        ref = d["references"][next(iter(d["references"]))]
        correct, distinct, same = [], [], []
        for case, caps in d["captured"].items():
            for s, (cl, rl) in enumerate(zip(caps, ref[case])):
                ids = torch.tensor(d["sequences"][case][s])
                for c, r in zip(cl, rl):
                    correct.append(row_errors(c, r))
                    if r.shape[0] > 1:
                        nb = torch.cat([row_errors(c[1:], r[:-1]), row_errors(c[:-1], r[1:])])
                        rep = torch.cat([ids[1:] == ids[:-1]] * 2)
                        distinct.append(nb[~rep])
                        same.append(nb[rep])
        a = torch.cat(correct).double()
        q = torch.quantile(a, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
        print(f"{path}: layers {d['layer_ids']}, {a.numel()} rows")
        print(f"  correct rows: p50 {q[0]:.2e}  p99 {q[1]:.2e}  p99.9 {q[2]:.2e}  max {a.max():.2e}")
        b = torch.cat(distinct).double()
        print(f"  neighbour's row in place, tokens differ: min {b.min():.2e}  p0.1 "
              f"{torch.quantile(b, 0.001):.2e}  median {b.median():.2e} (n={b.numel()})")
        sm = torch.cat(same)
        if sm.numel():
            print(f"  neighbour's row in place, same token id: min {sm.min():.2e}  max {sm.max():.2e} (n={sm.numel()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
