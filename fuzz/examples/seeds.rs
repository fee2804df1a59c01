//! Writes the seed corpus of `delta_decode` (valid deltas against its fixed base), a
//! few inputs for `chunk_roundtrip`, and valid conversations for `proto_frames` and
//! `proto_state`. Run from `fuzz/`:
//! `cargo run --example seeds` (the corpus directories are not in git).

use std::path::Path;

fn main() -> std::io::Result<()> {
    let decode_dir = Path::new("corpus/delta_decode");
    std::fs::create_dir_all(decode_dir)?;
    for (name, bytes) in aurora_fuzz::seed_deltas() {
        let path = decode_dir.join(format!("seed-{name}.adelta"));
        std::fs::write(&path, &bytes)?;
        println!("{}: {} bytes", path.display(), bytes.len());
    }
    let roundtrip_dir = Path::new("corpus/chunk_roundtrip");
    std::fs::create_dir_all(roundtrip_dir)?;
    for (name, bytes) in aurora_fuzz::seed_roundtrips() {
        let path = roundtrip_dir.join(format!("seed-{name}"));
        std::fs::write(&path, &bytes)?;
        println!("{}: {} bytes", path.display(), bytes.len());
    }
    for (name, bytes) in aurora_fuzz::proto::seed_streams() {
        for (target, input) in [("proto_state", &bytes[..]), ("proto_frames", &bytes[1..])] {
            let dir = Path::new("corpus").join(target);
            std::fs::create_dir_all(&dir)?;
            let path = dir.join(format!("seed-{name}"));
            std::fs::write(&path, input)?;
            println!("{}: {} bytes", path.display(), input.len());
        }
    }
    Ok(())
}
