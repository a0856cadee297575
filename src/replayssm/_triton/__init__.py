"""Triton machinery shared by the Mamba-2 and GDN kernels: number formats in registers
(``formats``) and launch plumbing (``launch``)."""
