//! TMA descriptors (CUtensorMap) for the stage-4 kernels, exactly as dhu_params.h
//! lists them. The parameter computation is a pure function (`dhu_specs`, tested
//! against the driver's documented limits); `build_tensor_maps` is the one place that
//! encodes them.
//!
//! `tensor_maps` wraps it in a per-signature cache: the seven maps depend on the
//! device, the dtype and the extents (`TmaKey`; the tensors are contiguous, so the
//! strides follow from the extents) and on seven addresses. A signature seen before
//! costs one lookup and a `cuTensorMapReplaceAddress` per changed address instead of
//! seven `cuTensorMapEncodeTiled`. The cache holds numbers only (keys and encoded
//! maps: no tensor, no Python object), is bounded (`TMA_CACHE_CAPACITY` entries, least
//! recently used evicted) and sits behind a mutex.

use crate::driver::{check, driver_present, require_driver};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::sys::{
    self, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use std::sync::{Mutex, OnceLock};

/// Rows (tokens: one chunk, cuda/dhu_layout.h's BT) and columns (64 16-bit elements: one
/// 128-byte swizzle span) of one TMA box of q, k, w, do, dv, dv2.
pub const BOX_ROWS: u32 = crate::facts::BT as u32;
pub const BOX_COLS: u32 = 64;
/// With 128-byte swizzle a box row may span at most 128 bytes.
pub const SWIZZLE_SPAN: u64 = 128;
pub const SWIZZLE: CUtensorMapSwizzle = CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
pub const L2_PROMOTION: CUtensorMapL2promotion = CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
/// Out-of-bounds elements read as zeros; out-of-bounds stores are clipped.
pub const OOB_FILL: CUtensorMapFloatOOBfill = CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
pub const INTERLEAVE: CUtensorMapInterleave = CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE;

/// The arguments of one cuTensorMapEncodeTiled call (rank 4, innermost dim first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaSpec {
    /// Which tensor, for error messages.
    pub tensor: &'static str,
    pub dtype: CUtensorMapDataType,
    pub elem_bytes: u64,
    pub address: u64,
    pub dims: [u64; 4],
    /// Byte strides of dims 1..3 (dim 0 is contiguous).
    pub strides: [u64; 3],
    pub box_dim: [u32; 4],
    pub element_strides: [u32; 4],
}

/// Extents the maps are built from. `nt` is chunks per batch row (dense) or the total
/// chunk count (varlen, B == 1): dh has B*NT checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TmaShape {
    pub b: u64,
    pub t: u64,
    pub h: u64,
    pub hv: u64,
    pub k: u64,
    pub v: u64,
    pub nt: u64,
    /// BF16 or F16 (q, k, w, do, dv, dv2, dh share it).
    pub dtype: DType,
    /// state_v_first: dh is [B, NT, HV, V, K].
    pub svf: bool,
}

/// Device addresses of the tensors behind the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaPointers {
    pub q: u64,
    pub k: u64,
    pub w: u64,
    pub do_: u64,
    pub dv: u64,
    pub dv2: u64,
    pub dh: u64,
}

fn tma_dtype(dtype: DType) -> Result<CUtensorMapDataType> {
    match dtype {
        DType::BF16 => Ok(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        DType::F16 => Ok(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        other => Err(Error::dtype("q", format!("expected dtype bfloat16 or float16 for the kernel, got {other}"))),
    }
}

/// A [rows..., row of `inner` elements] tensor tiled by (BOX_COLS, 1, BOX_ROWS, 1):
/// dims (inner, heads, T, B).
fn token_major(
    tensor: &'static str,
    s: &TmaShape,
    dt: CUtensorMapDataType,
    addr: u64,
    heads: u64,
    inner: u64,
) -> TmaSpec {
    let e = s.dtype.size_bytes();
    TmaSpec {
        tensor,
        dtype: dt,
        elem_bytes: e,
        address: addr,
        dims: [inner, heads, s.t, s.b],
        strides: [inner * e, heads * inner * e, s.t * heads * inner * e],
        box_dim: [BOX_COLS, 1, BOX_ROWS, 1],
        element_strides: [1; 4],
    }
}

/// The seven maps of DhuParams, in its order: q, k, w, do, dv, dv2, dh.
pub fn dhu_specs(s: &TmaShape, p: &TmaPointers) -> Result<[TmaSpec; 7]> {
    let dt = tma_dtype(s.dtype)?;
    let e = s.dtype.size_bytes();
    // dh is [B*NT, HV, K, V] (one box of 64 v x K k per store) or, with state_v_first,
    // [B*NT, HV, V, K] (boxes of 64 k x 64 v: the kernel stores K / 64 of them).
    let (inner, outer, box_outer) = if s.svf { (s.k, s.v, BOX_ROWS) } else { (s.v, s.k, s.k as u32) };
    let dh = TmaSpec {
        tensor: "dh",
        dtype: dt,
        elem_bytes: e,
        address: p.dh,
        dims: [inner, outer, s.hv, s.b * s.nt],
        strides: [inner * e, s.k * s.v * e, s.hv * s.k * s.v * e],
        box_dim: [BOX_COLS, box_outer, 1, 1],
        element_strides: [1; 4],
    };
    let specs = [
        token_major("q", s, dt, p.q, s.h, s.k),
        token_major("k", s, dt, p.k, s.h, s.k),
        token_major("w", s, dt, p.w, s.hv, s.k),
        token_major("do", s, dt, p.do_, s.hv, s.v),
        token_major("dv", s, dt, p.dv, s.hv, s.v),
        token_major("dv2", s, dt, p.dv2, s.hv, s.v),
        dh,
    ];
    for spec in &specs {
        check_spec(spec)?;
    }
    Ok(specs)
}

/// The limits cuTensorMapEncodeTiled documents for a non-interleaved, 128B-swizzled
/// map, checked before the call so that a failure names the reason.
pub fn check_spec(s: &TmaSpec) -> Result<()> {
    let bad = |msg: String| Err(Error::layout(s.tensor, format!("cannot build its TMA descriptor: {msg}")));
    if s.address % 16 != 0 {
        return bad(format!("address {:#x} is not 16-byte aligned", s.address));
    }
    for (i, &d) in s.dims.iter().enumerate() {
        if d == 0 || d > (1u64 << 32) {
            return bad(format!("dim {i} = {d} is not in [1, 2^32]"));
        }
    }
    for (i, &st) in s.strides.iter().enumerate() {
        if st % 16 != 0 || st >= (1u64 << 40) {
            return bad(format!("stride {} = {st} bytes is not a multiple of 16 below 2^40", i + 1));
        }
    }
    for (i, &b) in s.box_dim.iter().enumerate() {
        if b == 0 || b > 256 {
            return bad(format!("box dim {i} = {b} is not in [1, 256]"));
        }
    }
    let row = s.box_dim[0] as u64 * s.elem_bytes;
    if row % 16 != 0 || row > SWIZZLE_SPAN {
        return bad(format!("a box row of {row} bytes does not fit the 128-byte swizzle"));
    }
    if s.element_strides.iter().any(|&x| x == 0 || x > 8) {
        return bad("element strides must be in [1, 8]".into());
    }
    Ok(())
}

/// Encodes one map (cuTensorMapEncodeTiled).
pub fn encode(s: &TmaSpec) -> Result<CUtensorMap> {
    require_driver()?;
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has the rank's length (4, or 3 for the strides) and lives
    // across the call; the driver only writes `map`.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            s.dtype,
            4,
            s.address as *mut std::ffi::c_void,
            s.dims.as_ptr(),
            s.strides.as_ptr(),
            s.box_dim.as_ptr(),
            s.element_strides.as_ptr(),
            INTERLEAVE,
            SWIZZLE,
            L2_PROMOTION,
            OOB_FILL,
        )
    };
    check(res, || {
        format!(
            "cuTensorMapEncodeTiled for {} (dims {:?}, byte strides {:?}, box {:?})",
            s.tensor, s.dims, s.strides, s.box_dim
        )
    })?;
    Ok(map)
}

/// The seven descriptors of one call, in DhuParams order (q, k, w, do, dv, dv2, dh).
pub fn build_tensor_maps(shape: &TmaShape, ptrs: &TmaPointers) -> Result<[CUtensorMap; 7]> {
    let specs = dhu_specs(shape, ptrs)?;
    let mut maps = [CUtensorMap { opaque: [0; 16] }; 7];
    for (m, s) in maps.iter_mut().zip(specs.iter()) {
        *m = encode(s)?;
    }
    Ok(maps)
}

/// The seven addresses in DhuParams order (q, k, w, do, dv, dv2, dh), with their names.
fn addresses(p: &TmaPointers) -> [(&'static str, u64); 7] {
    [("q", p.q), ("k", p.k), ("w", p.w), ("do", p.do_), ("dv", p.dv), ("dv2", p.dv2), ("dh", p.dh)]
}

/// The per-call half of `check_spec`: every address 16-byte aligned (what TMA requires
/// of a global address), with `check_spec`'s message.
pub fn check_addresses(p: &TmaPointers) -> Result<()> {
    for (tensor, addr) in addresses(p) {
        if addr % 16 != 0 {
            return Err(Error::layout(
                tensor,
                format!("cannot build its TMA descriptor: address {addr:#x} is not 16-byte aligned"),
            ));
        }
    }
    Ok(())
}

/// Entries of the descriptor cache: one per (device, dtype, extents) signature.
pub const TMA_CACHE_CAPACITY: usize = 64;

/// Counters of a cache, for tests and `kda_dhu._core.tma_cache_info()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

/// A small least-recently-used map of plain values. Linear scans: with at most a few
/// dozen entries of a few words each, a scan is a few hundred nanoseconds at worst,
/// and a const constructor lets it live in a `static`.
#[derive(Debug)]
pub struct Lru<K, V> {
    /// (key, value, last use); unordered.
    entries: Vec<(K, V, u64)>,
    capacity: usize,
    clock: u64,
    stats: CacheStats,
}

impl<K: PartialEq + Copy, V: Copy> Lru<K, V> {
    pub const fn new(capacity: usize) -> Self {
        Lru { entries: Vec::new(), capacity, clock: 0, stats: CacheStats { hits: 0, misses: 0, evictions: 0 } }
    }

    /// The entry of `key`, marked most recently used; counts a hit or a miss.
    pub fn get(&mut self, key: &K) -> Option<&mut V> {
        self.clock += 1;
        let now = self.clock;
        match self.entries.iter_mut().find(|e| e.0 == *key) {
            Some(e) => {
                self.stats.hits += 1;
                e.2 = now;
                Some(&mut e.1)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Inserts or replaces `key`'s entry; at capacity, the least recently used entry
    /// makes room.
    pub fn insert(&mut self, key: K, value: V) {
        self.clock += 1;
        let now = self.clock;
        if let Some(e) = self.entries.iter_mut().find(|e| e.0 == key) {
            *e = (key, value, now);
            return;
        }
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() >= self.capacity {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].2).expect("capacity > 0");
            self.entries.swap_remove(oldest);
            self.stats.evictions += 1;
        }
        self.entries.push((key, value, now));
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.iter().any(|e| e.0 == *key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Drops every entry and zeroes the counters.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.stats = CacheStats::default();
    }
}

/// What the seven maps of a call depend on, besides the addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TmaKey {
    /// CUDA ordinal of the tensors.
    pub ordinal: i32,
    pub shape: TmaShape,
}

/// Seven encoded maps and the addresses they were last given.
#[derive(Clone, Copy)]
pub struct TmaEntry {
    pub maps: [CUtensorMap; 7],
    pub addrs: [u64; 7],
}

impl std::fmt::Debug for TmaEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TmaEntry").field("addrs", &self.addrs).finish_non_exhaustive()
    }
}

pub type TmaCache = Mutex<Lru<TmaKey, TmaEntry>>;

/// The process's descriptor cache.
static TMA_CACHE: TmaCache = Mutex::new(Lru::new(TMA_CACHE_CAPACITY));

fn lock(cache: &TmaCache) -> std::sync::MutexGuard<'_, Lru<TmaKey, TmaEntry>> {
    // A panic while holding the lock leaves whole entries (plain values): keep using it.
    cache.lock().unwrap_or_else(|e| e.into_inner())
}

/// The seven maps of a call from `cache`: on a hit, the cached maps with the addresses
/// that changed replaced (`replace`), on a miss `encode`d (outside the lock) and
/// stored. The addresses are checked on every call. `encode` and `replace` are the
/// driver calls in `tensor_maps`; tests pass fakes.
pub fn lookup_or_encode(
    cache: &TmaCache,
    key: TmaKey,
    ptrs: &TmaPointers,
    encode: impl FnOnce() -> Result<[CUtensorMap; 7]>,
    replace: impl Fn(&mut CUtensorMap, &'static str, u64) -> Result<()>,
) -> Result<[CUtensorMap; 7]> {
    check_addresses(ptrs)?;
    let named = addresses(ptrs);
    let addrs = named.map(|(_, a)| a);
    {
        let mut c = lock(cache);
        if let Some(e) = c.get(&key) {
            let mut maps = e.maps;
            for (i, &(tensor, addr)) in named.iter().enumerate() {
                if e.addrs[i] != addr {
                    replace(&mut maps[i], tensor, addr)?;
                }
            }
            *e = TmaEntry { maps, addrs };
            return Ok(maps);
        }
    }
    let maps = encode()?;
    lock(cache).insert(key, TmaEntry { maps, addrs });
    Ok(maps)
}

/// Whether the driver has `cuTensorMapReplaceAddress` (CUDA 12.0+, as is
/// `cuTensorMapEncodeTiled`); without it every call encodes.
fn replace_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: only looks the symbol up in the loaded libcuda.
        driver_present() && unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuTensorMapReplaceAddress").is_ok() }
    })
}

/// Points `map` at `addr` (cuTensorMapReplaceAddress: every other field kept).
fn replace_address(map: &mut CUtensorMap, tensor: &'static str, addr: u64) -> Result<()> {
    // SAFETY: `map` was encoded by cuTensorMapEncodeTiled; addr is 16-byte aligned
    // (checked by the caller).
    let res = unsafe { sys::cuTensorMapReplaceAddress(map, addr as *mut std::ffi::c_void) };
    check(res, || format!("cuTensorMapReplaceAddress for {tensor} (address {addr:#x})"))
}

/// The seven descriptors of a call on device `ordinal`, through the process's cache.
pub fn tensor_maps(ordinal: i32, shape: &TmaShape, ptrs: &TmaPointers) -> Result<[CUtensorMap; 7]> {
    require_driver()?;
    if !replace_supported() {
        return build_tensor_maps(shape, ptrs);
    }
    lookup_or_encode(
        &TMA_CACHE,
        TmaKey { ordinal, shape: *shape },
        ptrs,
        || build_tensor_maps(shape, ptrs),
        replace_address,
    )
}

/// (hits, misses, evictions, entries, capacity) of the process's cache.
pub fn cache_info() -> (CacheStats, usize, usize) {
    let c = lock(&TMA_CACHE);
    (c.stats(), c.len(), c.capacity())
}

/// Empties the process's cache (the next call of every signature encodes).
pub fn cache_clear() {
    lock(&TMA_CACHE).clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(k: u64, v: u64) -> TmaShape {
        TmaShape { b: 2, t: 1000, h: 4, hv: 8, k, v, nt: 16, dtype: DType::BF16, svf: false }
    }

    fn ptrs() -> TmaPointers {
        TmaPointers { q: 0x1000, k: 0x2000, w: 0x3000, do_: 0x4000, dv: 0x5000, dv2: 0x6000, dh: 0x7000 }
    }

    #[test]
    fn specs_follow_dhu_params_h() {
        let s = dhu_specs(&shape(128, 64), &ptrs()).unwrap();
        let names: Vec<&str> = s.iter().map(|x| x.tensor).collect();
        assert_eq!(names, ["q", "k", "w", "do", "dv", "dv2", "dh"]);
        // q, k: dims (K, H, T, B), strides (K*2, H*K*2, T*H*K*2), box (64, 1, 64, 1)
        assert_eq!(s[0].dims, [128, 4, 1000, 2]);
        assert_eq!(s[0].strides, [256, 4 * 256, 1000 * 4 * 256]);
        assert_eq!(s[0].box_dim, [64, 1, 64, 1]);
        assert_eq!(s[0].address, 0x1000);
        assert_eq!(s[1].dims, s[0].dims);
        assert_eq!(s[1].address, 0x2000);
        // w: (K, HV, T, B)
        assert_eq!(s[2].dims, [128, 8, 1000, 2]);
        assert_eq!(s[2].strides, [256, 8 * 256, 1000 * 8 * 256]);
        // do, dv, dv2: (V, HV, T, B)
        for x in &s[3..6] {
            assert_eq!(x.dims, [64, 8, 1000, 2]);
            assert_eq!(x.strides, [128, 8 * 128, 1000 * 8 * 128]);
            assert_eq!(x.box_dim, [64, 1, 64, 1]);
        }
        // dh: (V, K, HV, B*NT), strides (V*2, K*V*2, HV*K*V*2), box (64, K, 1, 1)
        assert_eq!(s[6].dims, [64, 128, 8, 32]);
        assert_eq!(s[6].strides, [128, 128 * 64 * 2, 8 * 128 * 64 * 2]);
        assert_eq!(s[6].box_dim, [64, 128, 1, 1]);
        assert!(s.iter().all(|x| x.element_strides == [1; 4]));
        assert!(s.iter().all(|x| x.dtype == CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16));
    }

    #[test]
    fn state_v_first_dh_is_v_rows_of_k() {
        // dh [B*NT, HV, V, K]: dims (K, V, HV, B*NT), strides (K*2, V*K*2, HV*V*K*2), box
        // (64 k, 64 v): the kernel stores K / 64 boxes per checkpoint. The other maps as is.
        let mut sh = shape(128, 192);
        let kv = dhu_specs(&sh, &ptrs()).unwrap();
        sh.svf = true;
        let s = dhu_specs(&sh, &ptrs()).unwrap();
        assert_eq!(s[6].dims, [128, 192, 8, 32]);
        assert_eq!(s[6].strides, [256, 192 * 128 * 2, 8 * 192 * 128 * 2]);
        assert_eq!(s[6].box_dim, [64, 64, 1, 1]);
        assert_eq!(kv[6].dims, [192, 128, 8, 32]);
        assert_eq!(kv[6].strides[1], s[6].strides[1]);
        assert_eq!(s[..6], kv[..6]);
    }

    #[test]
    fn k64_fp16_and_wide_v() {
        let mut sh = shape(64, 256);
        sh.dtype = DType::F16;
        let s = dhu_specs(&sh, &ptrs()).unwrap();
        assert!(s.iter().all(|x| x.dtype == CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16));
        assert_eq!(s[0].strides[0], 128);
        assert_eq!(s[3].dims[0], 256);
        assert_eq!(s[6].box_dim, [64, 64, 1, 1]);
    }

    #[test]
    fn limits_are_checked_with_the_tensor_named() {
        let mut p = ptrs();
        p.dv = 0x5008;
        let e = dhu_specs(&shape(128, 64), &p).unwrap_err();
        assert_eq!(e.to_string(), "dv: cannot build its TMA descriptor: address 0x5008 is not 16-byte aligned");

        let mut sh = shape(128, 64);
        sh.dtype = DType::F32;
        assert!(dhu_specs(&sh, &ptrs()).is_err());

        // A K that is not a multiple of 8 gives a stride that is not a multiple of 16.
        let e = dhu_specs(&shape(100, 64), &ptrs()).unwrap_err();
        assert!(e.to_string().starts_with("q: cannot build its TMA descriptor: stride 1 = 200"), "{e}");

        // dh's box spans K rows: K = 512 exceeds the 256 limit.
        let e = dhu_specs(&shape(512, 64), &ptrs()).unwrap_err();
        assert!(e.to_string().contains("box dim 1 = 512"), "{e}");
    }

    #[test]
    fn short_sequences_keep_a_full_box() {
        // T < 64: the box may exceed the tensor; TMA zero-fills / clips.
        let mut sh = shape(128, 64);
        sh.t = 5;
        sh.nt = 1;
        assert!(dhu_specs(&sh, &ptrs()).is_ok());
    }

    // ---- the descriptor cache, with fake encode / replace (no driver) ----

    /// Maps that carry their address in word 0 and an encode serial in word 1.
    fn fake_maps(p: &TmaPointers, serial: u64) -> [CUtensorMap; 7] {
        addresses(p).map(|(_, a)| {
            let mut m = CUtensorMap { opaque: [0; 16] };
            m.opaque[0] = a;
            m.opaque[1] = serial;
            m
        })
    }

    fn key(ordinal: i32, t: u64) -> TmaKey {
        let mut sh = shape(128, 64);
        sh.t = t;
        TmaKey { ordinal, shape: sh }
    }

    /// One call through `lookup_or_encode`: (maps, encoded?, replaced tensors).
    fn call(
        cache: &TmaCache,
        k: TmaKey,
        p: &TmaPointers,
        serial: u64,
    ) -> Result<([CUtensorMap; 7], bool, Vec<&'static str>)> {
        let encoded = std::cell::Cell::new(false);
        let replaced = std::cell::RefCell::new(Vec::new());
        let maps = lookup_or_encode(
            cache,
            k,
            p,
            || {
                encoded.set(true);
                Ok(fake_maps(p, serial))
            },
            |m, tensor, addr| {
                replaced.borrow_mut().push(tensor);
                m.opaque[0] = addr;
                Ok(())
            },
        )?;
        Ok((maps, encoded.get(), replaced.into_inner()))
    }

    fn addrs_of(maps: &[CUtensorMap; 7]) -> [u64; 7] {
        maps.map(|m| m.opaque[0])
    }

    #[test]
    fn a_miss_encodes_a_hit_replaces_only_changed_addresses() {
        let cache: TmaCache = Mutex::new(Lru::new(4));
        let p = ptrs();
        let (maps, encoded, replaced) = call(&cache, key(0, 1000), &p, 1).unwrap();
        assert!(encoded && replaced.is_empty());
        assert_eq!(addrs_of(&maps), [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000]);

        // Same signature, same pointers: the cached maps as they are.
        let (maps, encoded, replaced) = call(&cache, key(0, 1000), &p, 2).unwrap();
        assert!(!encoded && replaced.is_empty());
        assert!(maps.iter().all(|m| m.opaque[1] == 1), "the encode of the first call");

        // New outputs and a new q: three addresses replaced, nothing encoded.
        let mut p2 = p;
        p2.q = 0x11000;
        p2.dv2 = 0x16000;
        p2.dh = 0x17000;
        let (maps, encoded, replaced) = call(&cache, key(0, 1000), &p2, 3).unwrap();
        assert!(!encoded);
        assert_eq!(replaced, ["q", "dv2", "dh"]);
        assert_eq!(addrs_of(&maps), [0x11000, 0x2000, 0x3000, 0x4000, 0x5000, 0x16000, 0x17000]);
        assert!(maps.iter().all(|m| m.opaque[1] == 1));

        // Back to the first pointers: replaced again (the entry keeps the latest).
        let (maps, _, replaced) = call(&cache, key(0, 1000), &p, 4).unwrap();
        assert_eq!(replaced, ["q", "dv2", "dh"]);
        assert_eq!(addrs_of(&maps), addrs_of(&fake_maps(&p, 0)));

        let c = lock(&cache);
        assert_eq!(c.stats(), CacheStats { hits: 3, misses: 1, evictions: 0 });
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn signatures_differ_by_device_dtype_and_extents() {
        let cache: TmaCache = Mutex::new(Lru::new(8));
        let p = ptrs();
        let mut f16 = key(0, 1000);
        f16.shape.dtype = DType::F16;
        let mut nt = key(0, 1000);
        nt.shape.nt = 17;
        for k in [key(0, 1000), key(1, 1000), key(0, 999), f16, nt] {
            let (_, encoded, _) = call(&cache, k, &p, 0).unwrap();
            assert!(encoded, "{k:?} must be a miss");
        }
        assert_eq!(lock(&cache).len(), 5);
        for k in [key(0, 1000), key(1, 1000), key(0, 999), f16, nt] {
            let (_, encoded, _) = call(&cache, k, &p, 0).unwrap();
            assert!(!encoded, "{k:?} must be a hit");
        }
    }

    #[test]
    fn the_least_recently_used_entry_is_evicted() {
        let cache: TmaCache = Mutex::new(Lru::new(3));
        let p = ptrs();
        for t in [1, 2, 3] {
            call(&cache, key(0, t), &p, t).unwrap();
        }
        // Touch 1: 2 is now the oldest.
        assert!(!call(&cache, key(0, 1), &p, 0).unwrap().1);
        assert!(call(&cache, key(0, 4), &p, 4).unwrap().1);
        {
            let c = lock(&cache);
            assert_eq!(c.len(), 3);
            assert!(c.contains(&key(0, 1)) && c.contains(&key(0, 3)) && c.contains(&key(0, 4)));
            assert!(!c.contains(&key(0, 2)));
            assert_eq!(c.stats().evictions, 1);
        }
        // 2 encodes again.
        assert!(call(&cache, key(0, 2), &p, 5).unwrap().1);
        assert_eq!(lock(&cache).len(), 3);
        lock(&cache).clear();
        assert!(lock(&cache).is_empty());
        assert_eq!(lock(&cache).stats(), CacheStats::default());
    }

    #[test]
    fn bounded_at_its_capacity() {
        let cache: TmaCache = Mutex::new(Lru::new(TMA_CACHE_CAPACITY));
        let p = ptrs();
        for t in 1..=(3 * TMA_CACHE_CAPACITY as u64) {
            call(&cache, key(0, t), &p, t).unwrap();
        }
        let c = lock(&cache);
        assert_eq!(c.len(), TMA_CACHE_CAPACITY);
        assert_eq!(c.stats().evictions, 2 * TMA_CACHE_CAPACITY as u64);
        // The newest ones stay.
        assert!(c.contains(&key(0, 3 * TMA_CACHE_CAPACITY as u64)));
        assert!(!c.contains(&key(0, 1)));
    }

    #[test]
    fn alignment_is_checked_on_every_call_hit_or_miss() {
        let cache: TmaCache = Mutex::new(Lru::new(4));
        let mut p = ptrs();
        call(&cache, key(0, 1000), &p, 0).unwrap();
        p.dh = 0x7008;
        let e = call(&cache, key(0, 1000), &p, 0).unwrap_err();
        assert_eq!(e.to_string(), "dh: cannot build its TMA descriptor: address 0x7008 is not 16-byte aligned");
        // A failed call leaves the entry as it was.
        p.dh = 0x7000;
        let (maps, encoded, replaced) = call(&cache, key(0, 1000), &p, 0).unwrap();
        assert!(!encoded && replaced.is_empty());
        assert_eq!(maps[6].opaque[0], 0x7000);
    }

    #[test]
    fn an_encode_failure_caches_nothing_and_a_replace_failure_keeps_the_entry() {
        let cache: TmaCache = Mutex::new(Lru::new(4));
        let p = ptrs();
        let err = || Err(Error::Internal("encode".into()));
        assert!(lookup_or_encode(&cache, key(0, 1000), &p, err, |_, _, _| Ok(())).is_err());
        assert!(lock(&cache).is_empty());
        call(&cache, key(0, 1000), &p, 0).unwrap();
        let mut p2 = p;
        p2.q = 0x9000;
        let r = lookup_or_encode(
            &cache,
            key(0, 1000),
            &p2,
            || unreachable!(),
            |_, _, _| Err(Error::Internal("replace".into())),
        );
        assert!(r.is_err());
        let (maps, _, replaced) = call(&cache, key(0, 1000), &p, 0).unwrap();
        assert!(replaced.is_empty(), "the entry still holds the first addresses");
        assert_eq!(maps[0].opaque[0], 0x1000);
    }

    /// The cache cannot keep a tensor (or any Python object) alive: its keys and values
    /// are plain `Copy` numbers, 'static, shareable across threads.
    #[test]
    fn the_cache_holds_numbers_only() {
        fn plain<T: Copy + Send + Sync + 'static>() {}
        plain::<TmaKey>();
        plain::<TmaEntry>();
        // Nothing to drop: no reference count, no handle, no allocation.
        assert!(!std::mem::needs_drop::<TmaKey>() && !std::mem::needs_drop::<TmaEntry>());
    }

    #[test]
    fn the_cache_is_shared_safely_across_threads() {
        let cache: TmaCache = Mutex::new(Lru::new(8));
        std::thread::scope(|s| {
            for worker in 0..4u64 {
                let cache = &cache;
                s.spawn(move || {
                    for i in 0..200u64 {
                        let mut p = ptrs();
                        p.q = 0x10_0000 * (worker + 1) + 16 * i;
                        let (maps, _, _) = call(cache, key(0, 1 + i % 12), &p, i).unwrap();
                        assert_eq!(maps[0].opaque[0], p.q, "each call sees its own address");
                    }
                });
            }
        });
        let c = lock(&cache);
        assert_eq!(c.stats().hits + c.stats().misses, 800);
        assert!(c.len() <= 8);
    }

    #[test]
    fn without_a_driver_tensor_maps_is_an_error() {
        if !driver_present() {
            assert_eq!(tensor_maps(0, &shape(128, 64), &ptrs()).unwrap_err(), Error::NoDriver);
        }
    }
}
