//! CUDA kernels for both paths. Not built yet: see the GPU issue.
