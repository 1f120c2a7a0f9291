#!/usr/bin/env bash
# A branch merged onto main, laid out to run beside main on the device: `bash notes/device/carry_branch.sh
# wip/shared-pool _wip_pool` makes ./_wip_pool (git-ignored through .git/info/exclude) with graphify/
# (transforms/ and models/ inside it, as the editable install maps them), tests/ and pyproject.toml.
# Carry it (`run(carry=["_wip_pool"])`) and run pytest from inside it: `cd _wip_pool && python3 -m pytest ...`
# imports the branch's graphify, the tree's root stays main's.
# The copy has no built C helper (graphify/reads/_dictwatch, built by the device's `pip install -e .` into main's
# tree only): without it every call checks its watched dicts in Python, a host floor of about 1.2 ms a call that
# made a branch look 1.1-2.2x reduce-overhead on gpt2 and bert-base. On the device, after the install:
#   cp graphify/reads/_dictwatch*.so _wip_pool/graphify/reads/ && (cd _wip_pool && python3 -c \
#     "import graphify.reads.dict_marks as d; assert d.HELPER, d.__file__")
set -euo pipefail
branch=$1; out=$2; root=$(git rev-parse --show-toplevel); tmp=$(mktemp -d)
git -C "$root" worktree add -q "$tmp" main --detach
git -C "$tmp" -c user.email=dev@graphify -c user.name=graphify merge --no-edit -q "$branch"
rm -rf "$root/$out"; mkdir -p "$root/$out"
cp -r "$tmp/graphify" "$tmp/tests" "$tmp/pyproject.toml" "$root/$out/"
cp -r "$tmp/transforms" "$root/$out/graphify/transforms"; cp -r "$tmp/models" "$root/$out/graphify/models"
find "$root/$out" -name __pycache__ -prune -exec rm -rf {} +
grep -qx "/$out/" "$root/.git/info/exclude" || echo "/$out/" >> "$root/.git/info/exclude"
git -C "$root" worktree remove --force "$tmp"
echo "$out: $branch at $(git -C "$root" rev-parse --short "$branch") merged onto main at $(git -C "$root" rev-parse --short main)"
