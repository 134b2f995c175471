// Which keys of a K/V tile a thread loads (shared by the coop and packed kernels). The including
// kernel defines WG (threads), D4 (vec4 columns of a row), RS = WG / D4, FAST (a thread's column
// fixed, every word of the tile in range) and FOUR (FAST, and a thread's words a multiple of 4).
// Under FAST a thread keeps one column and its words step down the keys; with FOUR they come in
// runs of 4 consecutive keys, which lie in one block of a paged cache when the block size and the
// tile's first key are multiples of 4: a whole paged tile then needs one block-table read a run.

// Under FAST, the key of thread `tid`'s first word, and that of its word `it` from the first:
// with FOUR, keys 4r..4r+3 (r = tid / D4), then the same 4 * RS keys on; else r, r + RS, ...
fn run_first(tid: u32) -> u32 {
    if (FOUR) {
        return (tid / D4) * 4u;
    }
    return tid / D4;
}
fn run_step(it: u32) -> u32 {
    if (FOUR) {
        return (it / 4u) * RS * 4u + it % 4u;
    }
    return it * RS;
}
// The (key, column) slot of the tile, [key][d/4] a word, that thread `tid` loads as its word `it`.
fn run_slot(tid: u32, it: u32) -> u32 {
    if (FAST) {
        return (run_first(tid) + run_step(it)) * D4 + tid % D4;
    }
    return tid + it * WG;
}
