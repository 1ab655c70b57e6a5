"""Work of one request spread over devices: CFG-parallel's two ranks (sequence parallelism
joins later), and the guidance-branch wrappers they build on."""
