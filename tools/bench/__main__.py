from tools.bench.bench import main

raise SystemExit(main())
