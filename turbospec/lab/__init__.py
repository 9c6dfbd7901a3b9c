"""The lab: measuring tools built on the library (bench, client, quality, fit, tco) and their report writers;
`plots` draws every report's figures, `progress` the progress bars (terminal only).

Each tool is plain functions over configs and values; its command line lives in `turbospec.cli`, which this
package never imports."""
