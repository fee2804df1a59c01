//! One build of the delta codec on the whole synthetic checkpoint pair, measured as
//! `aurora bench codec` measures it on one thread: the plain scan and the extraction in
//! turns, then decode+apply, best of the rounds. `whole.sh` builds it once per codec
//! version, as a program of its own, so each version keeps its own code layout.

use delta::*;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = std::path::PathBuf::from(args.get(1).expect("usage: whole DATA_DIR [ROUNDS]"));
    let rounds: usize = args
        .get(2)
        .map_or(5, |r| r.parse().expect("ROUNDS is a number"));
    let base_bytes = std::fs::read(data.join("step-00000.safetensors")).expect("base checkpoint");
    let target_bytes =
        std::fs::read(data.join("step-00001.safetensors")).expect("target checkpoint");
    let base = Checkpoint::from_safetensors(&base_bytes).expect("parses");
    let target = Checkpoint::from_safetensors(&target_bytes).expect("parses");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let (base_hash, target_hash) = (base.weights_hash(), target.weights_hash());

    let (mut scan, mut extract, mut apply) = (f64::MAX, f64::MAX, f64::MAX);
    let mut delta = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let mut changed = 0;
        for (old, new) in base.tensors().iter().zip(target.tensors()) {
            for (x, y) in old.data.chunks(1 << 22).zip(new.data.chunks(1 << 22)) {
                changed += count_changed(x, y, old.dtype.size_bytes());
            }
        }
        std::hint::black_box(changed);
        scan = scan.min(started.elapsed().as_secs_f64());

        let started = Instant::now();
        let options = ExtractOptions {
            base_hash: Some(base_hash),
            target_hash: Some(target_hash),
            ..ExtractOptions::default()
        };
        delta = pool.install(|| {
            Extraction::new(&base, &target, options)
                .and_then(|extraction| extraction.to_bytes())
                .expect("extracts")
                .1
        });
        extract = extract.min(started.elapsed().as_secs_f64());
    }

    let mut image = base_bytes.clone();
    let layout = safetensors_layout(&image).expect("layout");
    let file = DeltaFile::parse(&delta).expect("parses");
    for _ in 0..rounds {
        let started = Instant::now();
        let mut patch = pool.install(|| {
            let view = Checkpoint::from_layout(&image, &layout).expect("view");
            check_base(file.header(), &view, Some(base_hash)).expect("base");
            decode(&file, &view).expect("decodes")
        });
        patch.swap_in_place(&mut image, &layout).expect("applies");
        apply = apply.min(started.elapsed().as_secs_f64());
        // Untimed: swapping again restores the base.
        patch.swap_in_place(&mut image, &layout).expect("restores");
    }

    let gbps = |seconds: f64| target.total_bytes() as f64 / seconds / 1e9;
    println!(
        "scan {:.2}  extract {:.2}  extract/scan {:.3}  decode+apply {:.2} GB/s  ({} bytes)",
        gbps(scan),
        gbps(extract),
        scan / extract,
        gbps(apply),
        delta.len()
    );
}
