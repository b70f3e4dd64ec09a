/* Every thread of a parallel region computes in its caller's floating-point mode.
 *
 * Flush-to-zero and denormals-are-zero are per-thread settings (x86: MXCSR). A
 * program that sets them on its main thread only (`torch.set_flush_denormal`)
 * would otherwise get subnormal results rounded one way in the outputs the main
 * thread computes and another way in those of the pool's other threads, so a
 * row's bits would depend on which thread computed it. Use:
 *
 *     FP_MODE_OF_CALLER;                   before the parallel region
 *     #pragma omp parallel ...
 *     { FP_MODE_ENTER; ... FP_MODE_LEAVE; }
 *
 * Elsewhere (no SSE) threads keep their own modes, IEEE unless a program changes them.
 */
#ifndef EXACTRL_FPMODE_H
#define EXACTRL_FPMODE_H
#if defined(__SSE__)
#include <xmmintrin.h>
#define FP_MODE_OF_CALLER const unsigned int caller_fp_mode_ = _mm_getcsr()
#define FP_MODE_ENTER                                   \
    const unsigned int own_fp_mode_ = _mm_getcsr();     \
    _mm_setcsr(caller_fp_mode_)
#define FP_MODE_LEAVE _mm_setcsr(own_fp_mode_)
#else
#define FP_MODE_OF_CALLER (void)0
#define FP_MODE_ENTER (void)0
#define FP_MODE_LEAVE (void)0
#endif
#endif
