//! Have-sets: which segments of a version a receiver holds, as index ranges
//! (docs/wire-protocol.md §4.3).

use std::ops::Range;

use crate::frame::MAX_HAVE_RANGES;

/// The runs of `true` in `present`, as sorted, disjoint, non-adjacent ranges. At most
/// [`MAX_HAVE_RANGES`] are returned: leaving a run out only makes the sender resend
/// segments the receiver then ignores as duplicates, it never loses one.
pub fn have_ranges(present: impl IntoIterator<Item = bool>) -> Vec<Range<u32>> {
    let mut ranges: Vec<Range<u32>> = Vec::new();
    let mut start = None;
    let mut index = 0u32;
    for held in present {
        match (held, start) {
            (true, None) => start = Some(index),
            (false, Some(s)) => {
                ranges.push(s..index);
                start = None;
            }
            _ => {}
        }
        index += 1;
        if ranges.len() == MAX_HAVE_RANGES {
            return ranges;
        }
    }
    if let Some(s) = start {
        ranges.push(s..index);
    }
    ranges
}

/// Whether `index` lies in one of the sorted `ranges`.
pub fn contains(ranges: &[Range<u32>], index: u32) -> bool {
    let at = ranges.partition_point(|r| r.end <= index);
    ranges.get(at).is_some_and(|r| r.start <= index)
}

#[cfg(test)]
// A have-set of one range is not a mistake.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    fn check(present: &[u8], expected: &[Range<u32>]) {
        let ranges = have_ranges(present.iter().map(|b| *b == 1));
        assert_eq!(ranges, expected);
        for (index, held) in present.iter().enumerate() {
            assert_eq!(contains(&ranges, index as u32), *held == 1, "index {index}");
        }
    }

    #[test]
    fn runs_become_ranges() {
        check(&[], &[]);
        check(&[0, 0], &[]);
        check(&[1, 1, 1], &[0..3]);
        check(&[0, 1, 1, 0, 1], &[1..3, 4..5]);
        check(&[1, 0, 1, 0, 1, 1], &[0..1, 2..3, 4..6]);
    }

    #[test]
    fn a_fragmented_set_is_capped_at_the_limit() {
        let alternating = (0..4 * MAX_HAVE_RANGES).map(|i| i % 2 == 0);
        let ranges = have_ranges(alternating);
        assert_eq!(ranges.len(), MAX_HAVE_RANGES);
        assert_eq!(ranges[MAX_HAVE_RANGES - 1], {
            let last = 2 * (MAX_HAVE_RANGES as u32 - 1);
            last..last + 1
        });
    }
}
