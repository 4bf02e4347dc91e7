"""The runtime layer every stage shares: process groups and launching (``dist``), one executor
for any stage on 1..N workers (``executor``), atomic outputs and manifests (``artifacts``) and
job-wide progress (``progress``)."""
