"""Work of one request spread over devices: CFG-parallel's two ranks, sequence parallelism's N
(Ulysses attention), and the guidance-branch wrappers they build on."""
