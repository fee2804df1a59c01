# Sourced by run.sh and whole.sh: where things go, the test data, and the workspace that
# builds two versions of the delta crate side by side.
root=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
work=$root/target/codec-ab
data=$work/data

# The learning rate `aurora bench codec` uses for 1% of BF16 elements changing.
if [ ! -f "$data/step-00001.safetensors" ]; then
    (cd "$root" && cargo run --release -q -p aurora-cli -- \
        synth --preset 0.6b --steps 1 --lr 7.934747827675892e-7 --out "$data")
fi

# Puts REV's delta crate in WS/before and the working tree's in WS/after, renamed so one
# workspace builds both, and the lock file in WS.
delta_crates() {
    local ws=$1 rev=$2
    rm -rf "$ws"
    mkdir -p "$ws/before"
    git -C "$root" archive "$rev" crates/delta | tar -x -C "$ws/before" --strip-components=2
    cp -r "$root/crates/delta" "$ws/after"
    for build in before after; do
        sed -i "s/^name = \"aurora-delta\"$/name = \"aurora-delta-$build\"/" "$ws/$build/Cargo.toml"
    done
    cp "$root/Cargo.lock" "$ws/Cargo.lock"
}

# The delta crate's own release settings in the manifest on stdin.
crate_settings() {
    sed -n '/^\[profile.release.package.aurora-delta\]/,/^\[/p' | grep -v '^\[' || true
}

# The workspace manifest for MEMBERS...: the project's shared package fields and external
# dependencies (which the delta crates inherit; its own crates stay out), its release
# profile, and the delta crate's release settings, the "before" build's taken from
# BEFORE_MANIFEST (a manifest's text) and the "after" build's from the working tree.
workspace_manifest() {
    local before_manifest=$1
    shift
    printf '[workspace]\nresolver = "3"\nmembers = ['
    printf '"%s", ' "$@"
    printf ']\n\n'
    sed -n '/^\[workspace.package\]/,/^\[profile/p' "$root/Cargo.toml" | grep -v '^\[profile' | grep -v '^aurora-'
    printf '[profile.release]\n'
    sed -n '/^\[profile.release\]/,/^\[/p' "$root/Cargo.toml" | grep -v '^\['
    printf '\n[profile.release.package.aurora-delta-before]\n'
    printf '%s\n' "$before_manifest" | crate_settings
    printf '\n[profile.release.package.aurora-delta-after]\n'
    crate_settings < "$root/Cargo.toml"
}
