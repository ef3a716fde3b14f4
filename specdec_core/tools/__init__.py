"""The `specdec` command line and the benchmark: front ends over the library, like the app."""
