/* Preloaded ahead of torch (LD_PRELOAD) by kernels/cpu/mkl_dispatch.py.
 *
 * MKL asks this exported function whether the CPU is Intel's before it picks its kernels, and on
 * any other vendor runs its generic AVX2 code whatever the CPU supports. Answering yes leaves the
 * choice to MKL's CPUID feature checks: AVX-512 kernels on a CPU that has AVX-512 (AMD Zen 4/5),
 * AVX2 ones on one that has only AVX2. MKL runs nothing the CPU lacks either way. */
int mkl_serv_intel_cpu_true(void) { return 1; }
