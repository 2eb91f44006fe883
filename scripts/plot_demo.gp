# Draws the collapse demo's figure (docs/collapse.png): loss scale and tau over steps, one panel
# per run. The figure goes to dir/collapse.png unless png names another file; the committed docs/collapse.png is
# drawn with
#
#   gnuplot -e "dir='out'; png='docs/collapse.png'" scripts/plot_demo.gp
#
# Reads the CSVs written by collapse_demo (step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite) in the
# order of the table (dir/index.txt; without it, every dir/*.csv by name). Needs gnuplot with the pngcairo terminal
# (Debian: gnuplot-nox).

if (!exists("dir")) dir = 'out'
if (!exists("png")) png = dir . '/collapse.png'

files = system("if [ -f " . dir . "/index.txt ]; then sed 's|^|" . dir . "/|; s|$|.csv|' " . dir . "/index.txt; else ls -1 " . dir . "/*.csv 2>/dev/null; fi")
n = words(files)
if (n == 0) { print "plot_demo.gp: no CSV files in " . dir; exit status 1 }

cols = (n <= 4) ? n : (n <= 6 ? 3 : 4)
rows = int((n + cols - 1) / cols)
set terminal pngcairo size 420 * cols, 330 * rows + 40 font "DejaVu Sans,9"
set output png

set datafile separator ","
set datafile missing ""
set key bottom left font ",8" samplen 2 opaque
set logscale y
set logscale y2
set format y "10^{%L}"
set format y2 "10^{%L}"
floor = 1e-8
set yrange [floor / 3 : 1e6]
set y2range [1e-6 : 10]
set ytics nomirror tc rgb "#1f4e9a"
set y2tics tc rgb "#b03a10"
set xlabel "step"
set grid ytics xtics lc rgb "#dddddd"

set multiplot layout rows, cols title "Loss scale (blue, left) and tau (orange, right) per step; red ticks: skipped steps" font ",11"
do for [i = 1 : n] {
  f = word(files, i)
  name = system("basename " . f . " .csv")
  set title name font ",10" noenhanced
  set ylabel (i - 1) % cols == 0 ? "loss scale (0 drawn at 10^{-8})" : ""
  set y2label i % cols == 0 || i == n ? "tau" : ""
  plot f using 1:($4 > floor ? $4 : floor) every ::1 with lines lw 1.6 lc rgb "#1f4e9a" title "loss scale", \
       f using 1:3 every ::1 axes x1y2 with lines lw 1.6 lc rgb "#b03a10" title "tau", \
       f using 1:($5 > 0 ? 2e5 : 1/0) every ::1 with points pt 7 ps 0.25 lc rgb "#d01010" notitle
}
unset multiplot
