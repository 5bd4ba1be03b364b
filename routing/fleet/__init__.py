"""The fleet as configured: what the control plane says exists, as the router reads it.

Owns: the immutable snapshot of workers, models, aliases and keys swapped in by the
refresher (snapshot), the fused load signal the policies read (load_signal), aliases and
their weighted targets (aliases), fallback chains (fallbacks), client keys without their
secrets (client_keys) and the priority classes (priority).

May import: routing's bottom modules, the standard library and orjson. Everything else in
routing may import it; it imports nothing above it.
"""
