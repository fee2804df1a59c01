#!/usr/bin/env bash
# Times the delta codec of the working tree against a git revision's (default HEAD) on
# the whole synthetic 0.6b step at 1% density, as `aurora bench codec` does on one thread
# (see whole.rs), taking turns: REV, working tree, REV, ...
#
#   tools/codec-ab/whole.sh [REV] [RUNS]
#
# Unlike run.sh, each version is a program of its own built with its own release
# settings, so neither one's code layout depends on the other's: in one binary, a change
# to one side was seen to move the other side's time by several percent.
set -euo pipefail
rev=${1:-HEAD}
runs=${2:-3}
source "$(dirname "$0")/common.sh"
ws=$work/whole

delta_crates "$ws" "$rev"
workspace_manifest "$(git -C "$root" show "$rev:Cargo.toml")" \
    before after whole-before whole-after > "$ws/Cargo.toml"
for build in before after; do
    mkdir -p "$ws/whole-$build/src"
    cp "$root/tools/codec-ab/whole.rs" "$ws/whole-$build/src/main.rs"
    cat > "$ws/whole-$build/Cargo.toml" <<TOML
[package]
name = "whole-$build"
version.workspace = true
edition.workspace = true

[dependencies]
delta = { package = "aurora-delta-$build", path = "../$build" }
rayon.workspace = true
TOML
done
(cd "$ws" && CARGO_TARGET_DIR="$work/target" cargo build --release -q)
echo "before: $rev ($(git -C "$root" rev-parse --short "$rev")), after: working tree"
for _ in $(seq "$runs"); do
    echo "before  $("$work/target/release/whole-before" "$data")"
    echo "after   $("$work/target/release/whole-after" "$data")"
done
