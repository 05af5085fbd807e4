from harness.workflow.cli import main

raise SystemExit(main())
