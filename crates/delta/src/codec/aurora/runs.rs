//! Runs of values replaced wholesale rather than nudged: cheaper as dense records, so
//! the encoder flags ranges that may hold them and the caller cuts them out.

use std::ops::Range;

use super::ESCAPE;
use super::changes::Change;
use crate::codec::scan::{Word, step_value};

/// The shortest run of replaced values worth a dense record of its own; a range is
/// searched for runs ([`escaped_runs`]) when it coded at least this many escaped steps
/// (steps beyond the rANS alphabet: values replaced rather than nudged, which cost about
/// twice their dense size) and half as many of its changes lie in streaks
/// ([`streaked_changes`]).
pub(super) const DENSE_RUN_ELEMENTS: usize = 256;

/// Changes of a class (in rank order) that lie in streaks of at least 32 consecutive
/// members of the class that all changed by escaped steps, counted in classes where at
/// most half the members changed. Where values were replaced wholesale every element
/// changed by a long step, so each class meets them as one streak; the changes of a
/// training step are spread and mostly short. (Measured on the 0.6B model's 10% step:
/// streaks of mere changes, escaped or not, reached 32 in 38 of its 272 ranges, since
/// neighbouring weights share gradients; a class of the smallest weights can change
/// almost everywhere by long steps, hence the density bound.) One pass over the
/// changes, which [`escaped_runs`], a pass over the range, is only worth after.
pub(super) fn streaked_changes(changes: &[Change]) -> usize {
    const STREAK: usize = 32;
    let Some(last) = changes.last() else {
        return 0;
    };
    if 2 * changes.len() as u64 > u64::from(last.rank) + 1 {
        return 0;
    }
    let (mut total, mut length) = (0, 0);
    // The rank of the streak's last change, while a streak is open.
    let mut previous: Option<u32> = None;
    for change in changes {
        let escaped = u64::from(change.step) >= ESCAPE;
        if escaped && previous.is_some_and(|p| change.rank == p + 1) {
            length += 1;
        } else {
            total += if length >= STREAK { length } else { 0 };
            length = usize::from(escaped);
        }
        previous = escaped.then_some(change.rank);
    }
    total + if length >= STREAK { length } else { 0 }
}

/// Runs of at least [`DENSE_RUN_ELEMENTS`] elements whose changes are escaped steps
/// (values replaced rather than nudged, as in an embedding row re-initialised), allowing
/// a few other elements between them: candidates for dense coding. Ranges in elements,
/// ascending.
pub(crate) fn escaped_runs<W: Word>(base: &[u8], target: &[u8]) -> Vec<Range<usize>> {
    /// Elements that are not escaped changes a run may hold in a row (a replaced value
    /// can land near the old one).
    const MAX_INTERRUPTION: usize = 4;
    let len = base.len() / W::BYTES;
    let mut runs = Vec::new();
    let mut run: Option<Range<usize>> = None;
    for index in 0..len {
        let (old, new) = (W::load(base, index), W::load(target, index));
        if old == new || step_value(old, new) < ESCAPE {
            continue;
        }
        run = match run {
            Some(current) if index - current.end <= MAX_INTERRUPTION => {
                Some(current.start..index + 1)
            }
            finished => {
                runs.extend(finished.filter(|r| r.len() >= DENSE_RUN_ELEMENTS));
                Some(index..index + 1)
            }
        };
    }
    runs.extend(run.filter(|r| r.len() >= DENSE_RUN_ELEMENTS));
    runs
}
