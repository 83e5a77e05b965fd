"""Flash I/O: direct-read engines (threads, Linux AIO, io_uring), read coalescing, the FFN reader, the disk profile."""
