//! Times two builds of the delta codec against each other in one process: `before` (a
//! git revision) and `after` (the working tree), call by call, so that the drift of a
//! shared machine, which moves whole runs by 15% within minutes, falls on both alike.
//! Built and run by `run.sh` next to this file.

use std::time::Instant;

/// Slices of this many elements, from this many large tensors: about 25 MB of model,
/// each slice timed best of REPS runs for both builds in turn.
const SLICE_ELEMENTS: usize = 1 << 20;
const SLICES: usize = 12;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = std::path::PathBuf::from(args.get(1).expect("usage: codec-ab DATA_DIR [REPS]"));
    let reps: usize = args
        .get(2)
        .map_or(15, |r| r.parse().expect("REPS is a number"));
    let base_bytes = std::fs::read(data.join("step-00000.safetensors")).expect("base checkpoint");
    let target_bytes =
        std::fs::read(data.join("step-00001.safetensors")).expect("target checkpoint");
    let checkpoint_before = |bytes| before::Checkpoint::from_safetensors(bytes).expect("parses");
    let checkpoint_after = |bytes| after::Checkpoint::from_safetensors(bytes).expect("parses");
    let (base_b, target_b) = (
        checkpoint_before(&base_bytes),
        checkpoint_before(&target_bytes),
    );
    let (base_a, target_a) = (
        checkpoint_after(&base_bytes),
        checkpoint_after(&target_bytes),
    );

    // Encoding: the same slices through both builds' `encode_chunk`.
    let picks: Vec<usize> = (0..base_a.tensors().len())
        .filter(|&i| base_a.tensors()[i].data.len() >= 4 * SLICE_ELEMENTS)
        .step_by(3)
        .take(SLICES)
        .collect();
    // Slice `range` of tensor `index` through one build's `encode_chunk`.
    macro_rules! encode {
        ($build:ident, $base:expr, $target:expr, $index:expr, $range:expr) => {
            || {
                $build::encode_chunk(
                    $build::Encoding::Aurora,
                    $base.tensors()[$index].dtype,
                    &$base.tensors()[$index].data[$range.clone()],
                    &$target.tensors()[$index].data[$range.clone()],
                )
                .expect("encodes")
                .map(|(_, payload)| payload)
            }
        };
    }
    let (mut time_b, mut time_a, mut same_bytes) = (0.0, 0.0, true);
    for &i in &picks {
        let range = 2 * SLICE_ELEMENTS..4 * SLICE_ELEMENTS;
        let ((best_b, out_b), (best_a, out_a)) = best_of_both(
            reps,
            encode!(before, base_b, target_b, i, range),
            encode!(after, base_a, target_a, i, range),
        );
        same_bytes &= out_b == out_a;
        time_b += best_b;
        time_a += best_a;
    }
    println!(
        "encode: before {:.3} ms, after {:.3} ms, after/before {:.3}{}",
        time_b * 1e3,
        time_a * 1e3,
        time_a / time_b,
        if same_bytes { "" } else { " (payloads differ)" }
    );

    // Decoding: each build decodes its own delta of the whole pair, segment by segment.
    // One chunk per segment, so each timed decode is one chunk's.
    macro_rules! delta {
        ($build:ident, $base:expr, $target:expr) => {
            $build::Extraction::new(
                $base,
                $target,
                $build::ExtractOptions {
                    segment_target_bytes: 1,
                    ..Default::default()
                },
            )
            .and_then(|extraction| extraction.to_bytes())
            .expect("extracts")
            .1
        };
    }
    let delta_b = delta!(before, &base_b, &target_b);
    let delta_a = delta!(after, &base_a, &target_a);
    let file_b = before::DeltaFile::parse(&delta_b).expect("parses");
    let file_a = after::DeltaFile::parse(&delta_a).expect("parses");
    let (mut time_b, mut time_a) = (0.0, 0.0);
    for index in (0..file_b.segment_count().min(file_a.segment_count())).step_by(12) {
        let segment_b = file_b.verify_segment(index).expect("verifies");
        let segment_a = file_a.verify_segment(index).expect("verifies");
        let ((best_b, _), (best_a, _)) = best_of_both(
            reps,
            || before::decode_segment(file_b.header(), index as u32, segment_b, &base_b),
            || after::decode_segment(file_a.header(), index as u32, segment_a, &base_a),
        );
        time_b += best_b;
        time_a += best_a;
    }
    println!(
        "decode: before {:.3} ms, after {:.3} ms, after/before {:.3} (deltas of {} and {} bytes)",
        time_b * 1e3,
        time_a * 1e3,
        time_a / time_b,
        delta_b.len(),
        delta_a.len()
    );
}

/// Best time of `reps` runs of each of `f` and `g`, taking turns call by call, and their
/// last results. Both read the same checkpoint bytes, so whichever runs second finds them
/// in cache: the order alternates.
fn best_of_both<T, U>(
    reps: usize,
    mut f: impl FnMut() -> T,
    mut g: impl FnMut() -> U,
) -> ((f64, T), (f64, U)) {
    fn timed<R>(best: &mut f64, f: &mut impl FnMut() -> R) -> R {
        let started = Instant::now();
        let result = std::hint::black_box(f());
        *best = best.min(started.elapsed().as_secs_f64());
        result
    }
    let (mut best_f, mut best_g) = (f64::INFINITY, f64::INFINITY);
    let (mut last_f, mut last_g) = (None, None);
    for rep in 0..reps {
        if rep % 2 == 0 {
            last_f = Some(timed(&mut best_f, &mut f));
            last_g = Some(timed(&mut best_g, &mut g));
        } else {
            last_g = Some(timed(&mut best_g, &mut g));
            last_f = Some(timed(&mut best_f, &mut f));
        }
    }
    let ran = "at least one run";
    ((best_f, last_f.expect(ran)), (best_g, last_g.expect(ran)))
}
