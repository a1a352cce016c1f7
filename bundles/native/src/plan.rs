//! Shard cuts of an index, the same cuts as `plan_shards` in bundles/shards.py, chosen in compiled code.

use crate::columns::u64_at;

const BLOCK: u64 = 512;

/// How a plan cuts: the target raw size, the most raw bytes a shard held whole may take, and how many
/// content-defined cut points fall on average within one target.
pub struct CutRules {
    pub shard_size: u64,
    pub held_raw_limit: u64,
    pub cuts_per_target: u64,
}

/// One shard of a plan: entries `first .. first + count`; `big` when it is one file standing alone.
pub struct Cut {
    pub first: usize,
    pub count: usize,
    pub big: bool,
}

fn padding(size: u64) -> u64 {
    (BLOCK - size % BLOCK) % BLOCK
}

/// Whether a shard past half its target may close after an entry of `entry` tar bytes named `path`
/// (bundles/shards.py `cuts_after`: the CRC-32 of the path below the entry's share of the cuts).
fn cuts_after(path: &[u8], entry: u64, rules: &CutRules) -> bool {
    let crc = u128::from(crc32fast::hash(path));
    crc * u128::from(rules.shard_size)
        < (u128::from(entry) * u128::from(rules.cuts_per_target)) << 32
}

/// The cuts of entries named `paths` (link targets `links`) of the sizes in `sizes` (native-endian u64s).
pub fn plan_cuts(paths: &[&[u8]], links: &[&[u8]], sizes: &[u8], rules: &CutRules) -> Vec<Cut> {
    let n = paths.len();
    let alone = rules.shard_size.min(rules.held_raw_limit / 2);
    let half = (rules.shard_size / 2).max(1);
    let mut cuts = Vec::new();
    let (mut first, mut filled, mut bound) = (0usize, 0u64, 2 * BLOCK);
    for i in 0..n {
        let size = u64_at(sizes, i);
        if size >= alone {
            if i > first {
                cuts.push(Cut {
                    first,
                    count: i - first,
                    big: false,
                });
            }
            cuts.push(Cut {
                first: i,
                count: 1,
                big: true,
            });
            (first, filled, bound) = (i + 1, 0, 2 * BLOCK);
            continue;
        }
        // size < alone <= held_raw_limit / 2: none of these sums can overflow
        let entry = BLOCK + size + padding(size);
        let most = entry + 3 * BLOCK + paths[i].len() as u64 + links[i].len() as u64;
        if i > first && bound + most > rules.held_raw_limit {
            cuts.push(Cut {
                first,
                count: i - first,
                big: false,
            });
            (first, filled, bound) = (i, 0, 2 * BLOCK);
        }
        filled += entry;
        bound += most;
        if filled >= rules.shard_size || (filled >= half && cuts_after(paths[i], entry, rules)) {
            cuts.push(Cut {
                first,
                count: i + 1 - first,
                big: false,
            });
            (first, filled, bound) = (i + 1, 0, 2 * BLOCK);
        }
    }
    if first < n || cuts.is_empty() {
        cuts.push(Cut {
            first,
            count: n - first,
            big: false,
        });
    }
    cuts
}
