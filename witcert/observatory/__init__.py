"""The observatory: WitCert on a real model, workloads, telemetry and reports (``witcert observe``).
"""
