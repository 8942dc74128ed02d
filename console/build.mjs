// Builds the console into `dist/` (or the directory given as the first argument):
// `index.html` and `console.css` as written, `console.js` bundled by esbuild from
// src/main.ts with @keel/client's sources. `keel serve` embeds `dist/`; `cargo xtask
// check` builds into a scratch directory and fails when the committed build differs.

import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const here = fileURLToPath(new URL(".", import.meta.url));
const out = process.argv[2] ?? join(here, "dist");
mkdirSync(out, { recursive: true });
for (const file of ["index.html", "console.css"]) {
  copyFileSync(join(here, "static", file), join(out, file));
}
await build({
  entryPoints: [join(here, "src/main.ts")],
  outfile: join(out, "console.js"),
  bundle: true,
  format: "esm",
  target: "es2022",
  platform: "browser",
  charset: "utf8",
  legalComments: "none",
  minify: true,
  logLevel: "warning",
});
