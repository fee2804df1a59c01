#!/usr/bin/env bash
# Times the delta codec of the working tree against a git revision's (default HEAD) in
# one process, call by call (see main.rs), on a synthetic 0.6b step at 1% density.
#
#   tools/codec-ab/run.sh [REV] [REPS]
#
# This machine's speed drifts by 15% or more between runs, more than most codec changes
# gain; interleaving the two builds is what makes a few percent measurable. The
# revision must have `aurora_delta::encode_chunk` (every commit since it was added).
# Everything it builds and generates stays under target/codec-ab.
set -euo pipefail
rev=${1:-HEAD}
reps=${2:-15}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$root/target/codec-ab
data=$work/data
ws=$work/workspace

# The learning rate `aurora bench codec` uses for 1% of BF16 elements changing.
if [ ! -f "$data/step-00001.safetensors" ]; then
    (cd "$root" && cargo run --release -q -p aurora-cli -- \
        synth --preset 0.6b --steps 1 --lr 7.934747827675892e-7 --out "$data")
fi

rm -rf "$ws"
mkdir -p "$ws/before" "$ws/bench"
git -C "$root" archive "$rev" crates/delta | tar -x -C "$ws/before" --strip-components=2
cp -r "$root/crates/delta" "$ws/after"
sed -i 's/^name = "aurora-delta"$/name = "aurora-delta-before"/' "$ws/before/Cargo.toml"
sed -i 's/^name = "aurora-delta"$/name = "aurora-delta-after"/' "$ws/after/Cargo.toml"
cp "$root/tools/codec-ab/main.rs" "$ws/bench/main.rs"
cp "$root/Cargo.lock" "$ws/Cargo.lock"
{
    printf '[workspace]\nresolver = "3"\nmembers = ["before", "after", "bench"]\n\n'
    # The project's shared package fields and external dependencies, which the delta
    # crate's manifest inherits; its own crates stay out.
    sed -n '/^\[workspace.package\]/,/^\[profile/p' "$root/Cargo.toml" | grep -v '^\[profile' | grep -v '^aurora-'
    printf '[profile.release]\n'
    sed -n '/^\[profile.release\]/,/^\[/p' "$root/Cargo.toml" | grep -v '^\['
    # The delta crate's own release settings, for both builds.
    for build in before after; do
        printf '\n[profile.release.package.aurora-delta-%s]\n' "$build"
        sed -n '/^\[profile.release.package.aurora-delta\]/,/^\[/p' "$root/Cargo.toml" | grep -v '^\['
    done
} > "$ws/Cargo.toml"
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
