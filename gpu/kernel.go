package gpu

// The copy kernel: scattered copies between any two of device memory and
// device-mapped pinned host memory, in one launch.
//
// A copy engine moves scattered blocks one DMA descriptor at a time, with
// a per-copy cost that dominates below a few hundred KiB; a kernel whose
// threads load and store the bytes themselves reaches most of the link
// (PCIe for host memory, HBM on the device) with a small grid. Pinned
// arenas are allocated device-mapped (CU_MEMHOSTALLOC_DEVICEMAP), so the
// kernel reads and writes host memory through its device address
// (cuMemHostGetDevicePointer), and its descriptor table lives in mapped
// pinned memory too (the engine's ring, ring.go): nothing is uploaded
// before a launch.
//
// The kernel is written in PTX by hand and embedded below, so building
// needs no CUDA toolkit: the driver JIT-compiles it for the device at the
// first launch (cuModuleLoadData). It targets sm_70 with ISA 7.0 (CUDA
// 11.0), so any CUDA 12 driver compiles it for Volta and everything newer,
// Hopper included; it needs sm_70 for shfl.sync after divergence
// (independent thread scheduling).
//
// # The table
//
// A launch reads ncta + nwarp descriptors of 32 bytes (source, destination
// and length as device addresses, and a pad), CTA items first:
//
//   - CTA items: a chunk of at most kernelChunk bytes of a piece larger
//     than warpMaxBytes. CTA c copies items c, c+nctaid, c+2·nctaid, …
//     with all its threads, 16-byte vectors, four in flight per thread; it
//     loads the next item's descriptor before copying the current one, so
//     the descriptor's latency (a PCIe round trip: the table is host
//     memory) hides behind the copy.
//   - Warp items: a whole piece of at most warpMaxBytes. Warp w of W in the
//     grid copies items w, w+W, w+2W, …: its 32 lanes load 32 of its items'
//     descriptors at once (one round trip for 32 items), then copy them one
//     after the other, each lane's descriptor broadcast with shfl.sync.
//
// Every block of every arena is 256-byte aligned and a multiple of 256
// bytes long, chunks start at multiples of kernelChunk, so every vector
// is aligned and no length has a remainder. Loads use the non-coherent
// path (ld.global.nc): nothing a launch reads is written during it (a
// copy never reads a block it writes, Start refuses that; a descriptor
// slot is rewritten only after the launch that read it completed).
//
// # The grid
//
// Host↔device launches are bounded by the engine's CTA budget (default
// 16, WithKernelCTAs): that is how many bytes in flight cover the PCIe
// link's bandwidth-delay product (see the package doc for the SM cost).
// A launch of warp items only may use up to four times as many CTAs when
// its pieces are small, so that it keeps as many bytes in flight as the
// CTA items would (a warp copies at most 2 KiB per round trip; a piece of
// 1 KiB uses half of that). Device-to-device launches read and write HBM,
// an order of magnitude faster than PCIe, and may use kernelDtoDPerSM CTAs
// per SM.

const (
	// kernelEntry is the kernel's entry name; kernelParams its parameter
	// count (descriptor table, CTA items, warp items).
	kernelEntry  = "kvl_copy"
	kernelParams = 3
	// kernelThreads is the launch's block size (the PTX's .maxntid).
	kernelThreads = 256
	// kernelWarps is the warps per CTA.
	kernelWarps = kernelThreads / 32
	// kernelChunk is the most bytes one CTA item covers.
	kernelChunk = 64 << 10
	// warpMaxBytes: pieces of at most this many bytes are warp items. A
	// warp moves 2 KiB per round of four vectors a lane; a CTA 16 KiB. A
	// piece of 8 KiB keeps a warp busy for four rounds, while a CTA would
	// copy it in half a round with most of its threads idle.
	warpMaxBytes = 8 << 10
	// descBytes is the size of one descriptor in the table.
	descBytes = 32
	// defaultKernelCTAs is the CTA budget of host↔device launches.
	defaultKernelCTAs = 16
	// kernelDtoDPerSM bounds device-to-device launches to this many CTAs
	// per SM (kernelDtoDFallbackCTAs when the SM count is unknown).
	kernelDtoDPerSM        = 4
	kernelDtoDFallbackCTAs = 512
)

// kernelDesc is one row of the kernel's table: copy n bytes from src to
// dst (device addresses). The layout is the PTX's: three u64 and a pad.
type kernelDesc struct {
	src, dst, n, _ uint64
}

// launch is one kernel launch: the device address of its table (a slot of
// the engine's ring), the item counts and the grid.
type launch struct {
	table       uint64
	ncta, nwarp uint32
	grid        uint32
}

// kernelItems returns how many CTA and warp items ops need, and the bytes
// of the warp items.
func kernelItems(ops []copyOp) (ncta, nwarp, warpBytes int) {
	for i := range ops {
		n := ops[i].n
		if n <= warpMaxBytes {
			nwarp++
			warpBytes += n
		} else {
			ncta += (n + kernelChunk - 1) / kernelChunk
		}
	}
	return ncta, nwarp, warpBytes
}

// fillKernelTable writes ops' items into table, which holds exactly the
// ncta CTA items and then the warp items that kernelItems counted.
// Addresses are the arenas' device addresses (dptr): a pinned arena's
// mapped address, never its host address.
func fillKernelTable(table []kernelDesc, ops []copyOp, ncta int) {
	c, w := 0, ncta
	for i := range ops {
		op := &ops[i]
		src, dst := op.src.dptr+uint64(op.srcOff), op.dst.dptr+uint64(op.dstOff)
		if op.n <= warpMaxBytes {
			table[w] = kernelDesc{src: src, dst: dst, n: uint64(op.n)}
			w++
			continue
		}
		for off := 0; off < op.n; off += kernelChunk {
			table[c] = kernelDesc{src: src + uint64(off), dst: dst + uint64(off), n: uint64(min(kernelChunk, op.n-off))}
			c++
		}
	}
}

// kernelGrid returns the CTAs of a launch of ncta CTA items and nwarp
// warp items of warpBytes bytes in all: enough for every item to have its
// own CTA or warp, at most the budget (see the comment at the top).
func kernelGrid(kind copyKind, ncta, nwarp, warpBytes, ctas, sms int) int {
	budget := ctas
	if kind == deviceToDevice {
		budget = kernelDtoDFallbackCTAs
		if sms > 0 {
			budget = sms * kernelDtoDPerSM
		}
	} else if ncta == 0 && nwarp > 0 {
		// Warp items only: keep the bytes in flight of a full warp round
		// (2 KiB a warp) with pieces smaller than that.
		mean := warpBytes / nwarp
		scale := 1
		for scale < 4 && mean*scale < 2048 {
			scale *= 2
		}
		budget *= scale
	}
	need := max(ncta, (nwarp+kernelWarps-1)/kernelWarps, 1)
	return min(need, budget)
}

// kernelPTX is the kernel (see the comment at the top). Parameters: the
// table's device address, the number of CTA items and of warp items;
// launched with kernelThreads threads per CTA.
const kernelPTX = `//
// kvlease copy kernel: kvl_copy(table, ncta, nwarp) copies the items of a
// table of {u64 src, u64 dst, u64 bytes, u64 pad} (device addresses,
// 16-byte aligned, bytes a positive multiple of 16): items 0..ncta-1 a CTA
// each, the next nwarp a warp each.
//
.version 7.0
.target sm_70
.address_size 64

.visible .entry kvl_copy(
	.param .u64 kvl_copy_table,
	.param .u32 kvl_copy_ncta,
	.param .u32 kvl_copy_nwarp
)
.maxntid 256, 1, 1
{
	.reg .pred 	%p<16>;
	.reg .b32 	%r<48>;
	.reg .b64 	%rd<48>;

	ld.param.u64 	%rd1, [kvl_copy_table];
	ld.param.u32 	%r1, [kvl_copy_ncta];
	ld.param.u32 	%r2, [kvl_copy_nwarp];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %nctaid.x;
	mov.u32 	%r5, %tid.x;
	mov.u32 	%r6, %ntid.x;

	// CTA items: this CTA's first item is ctaid, then every nctaid-th.
	// %rd3 the thread's first offset, %rd4 the CTA's pass (ntid*16), %rd5
	// four passes.
	mul.wide.u32 	%rd3, %r5, 16;
	mul.wide.u32 	%rd4, %r6, 16;
	shl.b64 	%rd5, %rd4, 2;
	mov.u32 	%r7, %r3;
	setp.ge.u32 	%p1, %r7, %r1;
	@%p1 bra 	WARPS;
	mul.wide.u32 	%rd6, %r7, 32;
	add.s64 	%rd7, %rd2, %rd6;
	ld.global.nc.v2.u64 	{%rd8, %rd9}, [%rd7];
	ld.global.nc.u64 	%rd10, [%rd7+16];

CTA_ITEM:
	// Load the next item's descriptor (%r8) before copying this one.
	add.u32 	%r8, %r7, %r4;
	setp.lt.u32 	%p2, %r8, %r1;
	mul.wide.u32 	%rd11, %r8, 32;
	add.s64 	%rd12, %rd2, %rd11;
	@%p2 ld.global.nc.v2.u64 	{%rd13, %rd14}, [%rd12];
	@%p2 ld.global.nc.u64 	%rd15, [%rd12+16];
	cvta.to.global.u64 	%rd16, %rd8;
	cvta.to.global.u64 	%rd17, %rd9;
	mov.u64 	%rd18, %rd3;

CTA_COPY:
	// Up to four vectors at off, off+pass, off+2pass, off+3pass, each
	// only below the item's length.
	setp.lt.u64 	%p3, %rd18, %rd10;
	@!%p3 bra 	CTA_NEXT;
	add.s64 	%rd19, %rd18, %rd4;
	add.s64 	%rd20, %rd19, %rd4;
	add.s64 	%rd21, %rd20, %rd4;
	setp.lt.u64 	%p4, %rd19, %rd10;
	setp.lt.u64 	%p5, %rd20, %rd10;
	setp.lt.u64 	%p6, %rd21, %rd10;
	add.s64 	%rd22, %rd16, %rd18;
	add.s64 	%rd23, %rd16, %rd19;
	add.s64 	%rd24, %rd16, %rd20;
	add.s64 	%rd25, %rd16, %rd21;
	ld.global.nc.v4.u32 	{%r9, %r10, %r11, %r12}, [%rd22];
	@%p4 ld.global.nc.v4.u32 	{%r13, %r14, %r15, %r16}, [%rd23];
	@%p5 ld.global.nc.v4.u32 	{%r17, %r18, %r19, %r20}, [%rd24];
	@%p6 ld.global.nc.v4.u32 	{%r21, %r22, %r23, %r24}, [%rd25];
	add.s64 	%rd26, %rd17, %rd18;
	add.s64 	%rd27, %rd17, %rd19;
	add.s64 	%rd28, %rd17, %rd20;
	add.s64 	%rd29, %rd17, %rd21;
	st.global.v4.u32 	[%rd26], {%r9, %r10, %r11, %r12};
	@%p4 st.global.v4.u32 	[%rd27], {%r13, %r14, %r15, %r16};
	@%p5 st.global.v4.u32 	[%rd28], {%r17, %r18, %r19, %r20};
	@%p6 st.global.v4.u32 	[%rd29], {%r21, %r22, %r23, %r24};
	add.s64 	%rd18, %rd18, %rd5;
	bra.uni 	CTA_COPY;

CTA_NEXT:
	@!%p2 bra 	WARPS;
	mov.u32 	%r7, %r8;
	mov.u64 	%rd8, %rd13;
	mov.u64 	%rd9, %rd14;
	mov.u64 	%rd10, %rd15;
	bra.uni 	CTA_ITEM;

WARPS:
	// Warp items follow the CTA items. %r28 this warp's item of the
	// round, %r29 the warps in the grid (W), %r30 items per round (32W),
	// %r31 the item whose descriptor this lane loads (warp + lane*W).
	setp.eq.u32 	%p7, %r2, 0;
	@%p7 bra 	DONE;
	shr.u32 	%r25, %r5, 5;
	and.b32 	%r26, %r5, 31;
	shr.u32 	%r27, %r6, 5;
	mad.lo.u32 	%r28, %r3, %r27, %r25;
	mul.lo.u32 	%r29, %r4, %r27;
	shl.b32 	%r30, %r29, 5;
	mad.lo.u32 	%r31, %r26, %r29, %r28;
	mul.wide.u32 	%rd30, %r1, 32;
	add.s64 	%rd31, %rd2, %rd30;
	mul.wide.u32 	%rd32, %r26, 16;

W_ROUND:
	// The round's first item is the same in every lane: a uniform exit.
	setp.ge.u32 	%p8, %r28, %r2;
	@%p8 bra 	DONE;
	setp.lt.u32 	%p9, %r31, %r2;
	mov.u64 	%rd33, 0;
	mov.u64 	%rd34, 0;
	mov.u64 	%rd35, 0;
	mul.wide.u32 	%rd36, %r31, 32;
	add.s64 	%rd37, %rd31, %rd36;
	@%p9 ld.global.nc.v2.u64 	{%rd33, %rd34}, [%rd37];
	@%p9 ld.global.nc.u64 	%rd35, [%rd37+16];
	mov.b64 	{%r32, %r33}, %rd33;
	mov.b64 	{%r34, %r35}, %rd34;
	cvt.u32.u64 	%r36, %rd35;
	mov.u32 	%r37, 0;

W_ITEM:
	// Lane %r37's item, broadcast; a length of 0 (past the last item)
	// ends the round in every lane alike.
	shfl.sync.idx.b32 	%r38, %r36, %r37, 31, 0xffffffff;
	setp.eq.u32 	%p10, %r38, 0;
	@%p10 bra 	W_NEXT;
	shfl.sync.idx.b32 	%r39, %r32, %r37, 31, 0xffffffff;
	shfl.sync.idx.b32 	%r40, %r33, %r37, 31, 0xffffffff;
	shfl.sync.idx.b32 	%r41, %r34, %r37, 31, 0xffffffff;
	shfl.sync.idx.b32 	%r42, %r35, %r37, 31, 0xffffffff;
	mov.b64 	%rd38, {%r39, %r40};
	mov.b64 	%rd39, {%r41, %r42};
	cvta.to.global.u64 	%rd38, %rd38;
	cvta.to.global.u64 	%rd39, %rd39;
	cvt.u64.u32 	%rd40, %r38;
	mov.u64 	%rd41, %rd32;

W_COPY:
	// As CTA_COPY with the warp's pass: 32 lanes of 16 bytes.
	setp.lt.u64 	%p11, %rd41, %rd40;
	@!%p11 bra 	W_DONE;
	add.s64 	%rd42, %rd41, 512;
	add.s64 	%rd43, %rd41, 1024;
	add.s64 	%rd44, %rd41, 1536;
	setp.lt.u64 	%p12, %rd42, %rd40;
	setp.lt.u64 	%p13, %rd43, %rd40;
	setp.lt.u64 	%p14, %rd44, %rd40;
	add.s64 	%rd22, %rd38, %rd41;
	add.s64 	%rd23, %rd38, %rd42;
	add.s64 	%rd24, %rd38, %rd43;
	add.s64 	%rd25, %rd38, %rd44;
	ld.global.nc.v4.u32 	{%r9, %r10, %r11, %r12}, [%rd22];
	@%p12 ld.global.nc.v4.u32 	{%r13, %r14, %r15, %r16}, [%rd23];
	@%p13 ld.global.nc.v4.u32 	{%r17, %r18, %r19, %r20}, [%rd24];
	@%p14 ld.global.nc.v4.u32 	{%r21, %r22, %r23, %r24}, [%rd25];
	add.s64 	%rd26, %rd39, %rd41;
	add.s64 	%rd27, %rd39, %rd42;
	add.s64 	%rd28, %rd39, %rd43;
	add.s64 	%rd29, %rd39, %rd44;
	st.global.v4.u32 	[%rd26], {%r9, %r10, %r11, %r12};
	@%p12 st.global.v4.u32 	[%rd27], {%r13, %r14, %r15, %r16};
	@%p13 st.global.v4.u32 	[%rd28], {%r17, %r18, %r19, %r20};
	@%p14 st.global.v4.u32 	[%rd29], {%r21, %r22, %r23, %r24};
	add.s64 	%rd41, %rd41, 2048;
	bra.uni 	W_COPY;

W_DONE:
	add.u32 	%r37, %r37, 1;
	setp.lt.u32 	%p15, %r37, 32;
	@%p15 bra 	W_ITEM;

W_NEXT:
	add.u32 	%r28, %r28, %r30;
	add.u32 	%r31, %r31, %r30;
	bra.uni 	W_ROUND;

DONE:
	ret;
}
`
