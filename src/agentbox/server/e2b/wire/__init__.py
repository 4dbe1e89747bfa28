"""Generated code of E2B's envd Connect services (proto/envd; scripts/gen-envd.sh)."""
