#!/usr/bin/env bash
# Times the delta codec of the working tree against a git revision's (default HEAD) in
# one process, call by call (see main.rs), on a synthetic 0.6b step at 1% density.
#
#   tools/codec-ab/run.sh [REV] [REPS]
#
# This machine's speed drifts by 15% or more between runs, more than most codec changes
# gain; interleaving the two builds is what makes a few percent measurable. The
# revision must have `aurora_delta::encode_chunk` (every commit since it was added).
# Everything it builds and generates stays under target/codec-ab. Both versions share one
# binary, so a change to one can move the other's code layout and time by a few percent:
# confirm a gain on the whole model with whole.sh, which builds them apart.
set -euo pipefail
rev=${1:-HEAD}
reps=${2:-15}
source "$(dirname "$0")/common.sh"
ws=$work/workspace

delta_crates "$ws" "$rev"
mkdir -p "$ws/bench"
cp "$root/tools/codec-ab/main.rs" "$ws/bench/main.rs"
# Both builds with the working tree's settings: this compares code only.
workspace_manifest "$(cat "$root/Cargo.toml")" before after bench > "$ws/Cargo.toml"
cat > "$ws/bench/Cargo.toml" <<'TOML'
[package]
name = "codec-ab"
version.workspace = true
edition.workspace = true

[[bin]]
name = "codec-ab"
path = "main.rs"

[dependencies]
before = { package = "aurora-delta-before", path = "../before" }
after = { package = "aurora-delta-after", path = "../after" }
TOML
(cd "$ws" && CARGO_TARGET_DIR="$work/target" cargo build --release -q)
echo "before: $rev ($(git -C "$root" rev-parse --short "$rev")), after: working tree"
"$work/target/release/codec-ab" "$data" "$reps"
